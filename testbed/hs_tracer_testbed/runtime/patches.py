"""The testbed's changes to SGLang 0.5.23's behaviour, applied in the launcher process and (through
``pythonpath/sitecustomize.py``) in every process SGLang spawns. Never applied by the production
plugin.

Each patch runs when the SGLang module it touches is first imported (a post-import hook), or at
once if it is already imported, so installing them costs nothing at interpreter start:

* ``sglang.srt.models.deepseek_common.attention_backend_handler``: DeepSeek's attention picks a
  forward method per backend through ``AttentionBackendRegistry``; ``torch_native`` and
  ``intel_amx`` have no entry there and fall back to the Triton handler, which picks MHA for a fresh
  prefill against the MLA latent cache (a shape error). Both are registered to the absorbed MLA
  method, which runs on any backend that reads a latent KV cache.
* ``sglang.srt.runtime_context``: the platform fact ``has_amx`` is overridden to True so that
  SGLang keeps ``attention_backend="intel_amx"`` (its only CPU backend with EAGLE support) instead
  of falling back to ``torch_native`` on CPUs without AMX. The backend's kernels are the testbed's
  pure-torch ops. ``cpu_has_amx_support()`` itself stays False (it probes for the
  ``convert_weight_packed`` op, which the testbed never registers), so linear, MoE, norm and
  embedding layers keep their ``forward_native`` paths.
* ``sglang.srt.arg_groups.overrides`` (0.5.15 to 0.5.18, which have no ``override_platform``): the
  same fallback sits in its post-processing step, which asks ``cpu_has_amx_support()``; there (only
  in that module, whose other readers pick gpt-oss and MoE-runner backends the testbed's models do
  not use) it answers True, so ``intel_amx`` stays.
* ``sglang.srt.distributed.parallel_state``: with more than one rank (``tp_size`` 2) SGLang builds
  every process group with pynccl on (it does so for every in-tree platform, CPU included); where
  the installed torch carries ``libnccl.so.2`` (a CUDA build) ``PyNcclCommunicator`` then raises
  ``Expected a cuda device, but got: cpu`` while the groups are built. On the CPU the groups are
  built with pynccl off, so collectives run through ``torch.distributed`` over gloo (what SGLang
  does on a CPU without AMX anyway).
* ``sglang.srt.models.kimi_k25_eagle3``: Kimi-K2.5's MLA draft ends ``set_embed`` and
  ``set_embed_and_head`` with ``torch.cuda.empty_cache()`` and ``torch.cuda.synchronize()``, which
  raise on a CPU-only torch; on the testbed those two calls do nothing during those methods.
* ``sglang.srt.entrypoints.engine`` (the newest release, where the engine tests check it): the
  engine's processes are forked from a server process that has imported SGLang once, instead of
  spawned (:mod:`.forkserver`: the same code, less of the start's CPU).

With ``HS_TRACER_TESTBED_MISCAPTURE`` set, the target's capture loop feeds other layers than its
record says (:mod:`.miscapture`; the tests of in-engine layer identity).

An older SGLang release gets its own module on top (:func:`release_patches`: 0.5.11 to 0.5.15 in
:mod:`.release_0_5_11`, 0.5.16 to 0.5.19 in :mod:`.release_0_5_16`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType

from hs_tracer_testbed.runtime.forkserver import use_forkserver

HANDLER_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"
RUNTIME_CONTEXT_MODULE = "sglang.srt.runtime_context"
KIMI_DRAFT_MODULE = "sglang.srt.models.kimi_k25_eagle3"
PARALLEL_STATE_MODULE = "sglang.srt.distributed.parallel_state"
ENGINE_MODULE = "sglang.srt.entrypoints.engine"
MLA_BACKENDS = ("torch_native", "intel_amx")


def _mla_for_all(attn: object, forward_batch: object) -> object:
    """AttentionBackendRegistry handler: always the absorbed MLA forward method."""
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    return AttnForwardMethod.MLA


def register_mla_handlers(module: ModuleType) -> None:
    for backend in MLA_BACKENDS:
        module.AttentionBackendRegistry.register(backend, _mla_for_all)


def override_amx_platform_fact(module: ModuleType) -> None:
    # Installed without probing first: the probe imports sglang.srt.utils.common, which is
    # usually still initialising (it imports runtime_context) when this hook runs.
    override = getattr(module, "override_platform", None)  # releases before 0.5.19 have none
    if override is not None:
        override(has_amx=True).install()


def keep_intel_amx_in_overrides(module: ModuleType) -> None:
    if hasattr(module, "cpu_has_amx_support"):  # 0.5.19 on decide through override_platform
        module.cpu_has_amx_support = lambda: True


@contextlib.contextmanager
def _no_cuda_cache_calls() -> object:
    import torch

    saved = torch.cuda.empty_cache, torch.cuda.synchronize
    torch.cuda.empty_cache = torch.cuda.synchronize = lambda *_a, **_k: None
    try:
        yield
    finally:
        torch.cuda.empty_cache, torch.cuda.synchronize = saved


def cpu_embed_sharing(module: ModuleType) -> None:
    cls = module.Eagle3DeepseekV2ForCausalLM
    for name in ("set_embed", "set_embed_and_head"):
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(self: object, *args: object, _original: Callable[..., None] = original) -> None:
            with _no_cuda_cache_calls():
                _original(self, *args)

        setattr(cls, name, wrapper)


def no_pynccl_on_cpu(module: ModuleType) -> None:
    import inspect

    cls = module.GroupCoordinator
    original = cls.__init__
    signature = inspect.signature(original)
    off = {name: False for name in ("use_pynccl", "use_custom_allreduce") if name in signature.parameters}

    @functools.wraps(original)
    def init(self: object, *args: object, **kwargs: object) -> None:
        from sglang.srt.utils.common import is_cpu

        if is_cpu():
            bound = signature.bind(self, *args, **kwargs)
            bound.arguments.update(off)
            args, kwargs = bound.args[1:], bound.kwargs
        original(self, *args, **kwargs)

    cls.__init__ = init


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    HANDLER_MODULE: register_mla_handlers,
    RUNTIME_CONTEXT_MODULE: override_amx_platform_fact,
    "sglang.srt.arg_groups.overrides": keep_intel_amx_in_overrides,
    KIMI_DRAFT_MODULE: cpu_embed_sharing,
    PARALLEL_STATE_MODULE: no_pynccl_on_cpu,
}


class PostImportHook(importlib.abc.MetaPathFinder):
    """Runs a callback right after a watched module has executed, via its own loader instance
    (shared with the GPU runtime's patches)."""

    def __init__(self) -> None:
        self.pending: dict[str, Callable[[ModuleType], None]] = {}

    def install(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        """Apply each patch now (module already imported) or right after its first import."""
        for name, patch in patches.items():
            module = sys.modules.get(name)
            if module is not None:
                patch(module)
            else:
                self.pending[name] = patch
        if self.pending and self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def find_spec(self, fullname: str, path: object, target: object = None) -> object:
        callback = self.pending.pop(fullname, None)
        if callback is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            callback(module)

        # Loader instances are per module (FileFinder creates one per spec), so shadowing the
        # method on the instance touches nothing else and keeps get_source & co. intact.
        loader.exec_module = exec_module
        return spec


_hook = PostImportHook()


def release_patches() -> tuple[dict[str, str], dict[str, Callable[[ModuleType], None]]]:
    """The environment and patches the installed SGLang release needs on top of these (none for
    the newest; read from the distribution's metadata, without importing SGLang)."""
    from hs_tracer.integrations.sglang.releases import NEWEST_RELEASE, release_of
    from hs_tracer.integrations.sglang.versions import installed_version
    from hs_tracer_testbed.runtime import release_0_5_11, release_0_5_16

    version = installed_version()
    release = release_of(version) if version is not None else None
    if release in release_0_5_11.RELEASES:
        return release_0_5_11.ENV, release_0_5_11.patches(release)
    if release in release_0_5_16.RELEASES:
        return release_0_5_16.ENV, release_0_5_16.PATCHES
    if release == NEWEST_RELEASE:
        return {}, {ENGINE_MODULE: use_forkserver}
    return {}, {}


def install() -> None:
    """Apply every patch now (module already imported) or right after its first import."""
    from hs_tracer_testbed.runtime import miscapture

    _hook.install({**PATCHES, **release_patches()[1], **miscapture.patches()})
