"""The vLLM tests run in vLLM's own venv (.venv-vllm, ``make test-vllm``): real vLLM engines on CPU
with the vLLM testbed pair (hs_tracer_testbed.llama_pair), each engine started once per session
(tests/on_vllm/engines.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def pair():
    from hs_tracer_testbed.llama_pair import ensure_llama_pair

    return ensure_llama_pair()


@pytest.fixture(scope="session")
def pair_profile(pair) -> Path:
    from hs_tracer_testbed.llama_pair import profile

    return profile(pair)


@pytest.fixture(scope="session")
def vllm_engines(pair, pair_profile, tmp_path_factory):
    from tests.on_vllm.engines import Engines

    return Engines(pair, pair_profile, tmp_path_factory.mktemp("vllm"))
