"""Shared pytest setup. Engine tests (``-m engine``) start real SGLang processes on the CPU."""

pytest_plugins = ["tests.infra.fixtures"]
