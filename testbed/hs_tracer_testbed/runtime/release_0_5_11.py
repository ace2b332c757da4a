"""The CPU testbed's changes for SGLang 0.5.11 to 0.5.15 (on top of :mod:`.patches`), never applied
by the production plugin: what it takes to serve EAGLE-3 on these releases without a GPU.

They have no CPU attention backend for EAGLE: their ``DraftBackendFactory`` maps no CPU backend
(``EAGLE is not supported in decode attention backend intel_amx``), their ``IntelAMXAttnBackend``
knows neither the verify step nor draft decode steps and calls the C++ ops with an older argument
list than the testbed's pure-torch ops take. SGLang 0.5.16 added both for CPU (``IntelAMXAttnBackend``
with verify metadata and per-step draft metadata, and ``IntelAMXMultiStepDraftBackend`` built from
one such backend per draft step). This module gives 0.5.11 to 0.5.15 the same, in pure torch over
the testbed's kernels:

* :class:`CpuAttnBackend` replaces ``intel_amx`` in the release's attention registry: prefill and
  draft extend, the verify step (each request extends by its draft tokens; with topk > 1 the tree
  mask SGLang built decides what a draft token sees), and decode steps;
* :class:`CpuMultiStepDraftBackend` is one :class:`CpuAttnBackend` per draft step, each seeing the
  request's prefix plus the draft tokens up to its step (0.5.23's layout), registered for
  ``intel_amx`` in ``DraftBackendFactory``;
* the two EAGLE tree ops that these releases only call on CUDA (``build_tree_kernel_efficient``,
  and ``verify_tree_greedy``, which they skip on other devices without a word) call the testbed's
  pure-torch versions;
* ``server_args`` keeps ``attention_backend="intel_amx"`` (it falls back to ``torch_native`` on CPUs
  without AMX, and the draft factory has no entry for that either); from 0.5.15 on that fallback
  sits in ``arg_groups.overrides``, which :mod:`.patches` already answers;
* ``LlamaForCausalLM.set_embed``/``set_embed_and_head`` (the EAGLE-3 draft shares the target's
  embedding) end with ``torch.cuda.synchronize()``, which raises without CUDA: a no-op there;
* the draft KV pool warms up a Triton KV-copy kernel that follows raw device pointers (no
  interpreter can run it): no warm-up, and ``SGLANG_NATIVE_MOVE_KV_CACHE=1`` moves KV in torch;
* the overlap scheduler's ``FutureMap`` marks tensors with ``Tensor.record_stream``, which raises
  for a CPU tensor (0.5.23 skips it on CPU): for CPU tensors a no-op there (``resolve_future``
  before 0.5.13, ``_resolve_spec_extras`` from 0.5.13 on). Before 0.5.13 ``EAGLEWorkerV2.verify``
  calls it too; from 0.5.13 on verify goes through helpers that skip non-CUDA tensors;
* the V2 worker's verify step asks ``assign_extend_cache_locs_func`` for its cache slots, which
  returns nothing on a CPU (no branch for it): on a CPU it runs the release's own Triton kernel, as
  on CUDA (interpreted, below). The function lives in ``speculative.eagle_info_v2`` before 0.5.13
  and in ``speculative.triton_ops.cache_locs`` from 0.5.13 on (imported by name from there, so it
  is replaced before any importer runs);
* :data:`ENV`: the EAGLE path runs its small bookkeeping kernels (cache-slot assignment,
  draft-extend inputs) in Triton on CPU tensors; Triton's interpreter runs them on the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from hs_tracer_testbed.runtime.kernels import attention, speculative

RELEASES = ("0.5.11", "0.5.12", "0.5.13", "0.5.14", "0.5.15")
ENV = {"TRITON_INTERPRET": "1", "SGLANG_NATIVE_MOVE_KV_CACHE": "1"}


class CpuAttnBackend:
    """Pure-torch CPU attention for these releases (an ``AttentionBackend`` once :func:`_backend_class`
    has mixed in SGLang's base class): the testbed's ``extend_attention``/``decode_attention``."""

    def __init__(self, model_runner: Any) -> None:
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        server_args = model_runner.server_args
        self.topk = int(getattr(server_args, "speculative_eagle_topk", None) or 1)
        self.extend_metadata: tuple[Any, ...] | None = None
        self.draft_decode_metadata: tuple[Any, ...] | None = None

    # ---- metadata ---------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: Any) -> None:
        mode = forward_batch.forward_mode
        self.extend_metadata = None if mode.is_decode_or_idle() else self._extend_metadata(forward_batch)

    def _extend_metadata(self, fb: Any) -> tuple[Any, ...]:
        """(seq_lens, extend_seq_lens, extend_start_loc, tree_mask) of an extend-like forward. A
        verify batch carries no extend fields: each request extends by its draft tokens."""
        if not fb.forward_mode.is_target_verify():
            return fb.seq_lens, fb.extend_seq_lens, fb.extend_start_loc, None
        spec = fb.spec_info
        ndt = int(spec.draft_token_num)
        bs = fb.batch_size
        ext = torch.full((bs,), ndt, dtype=torch.int32, device=self.device)
        start = torch.arange(0, bs * ndt, ndt, dtype=torch.int32, device=self.device)
        mask = None
        if self.topk != 1 and spec.custom_mask is not None and spec.custom_mask.numel() > 0:
            mask = _draft_blocks(spec.custom_mask, fb.seq_lens, ndt)
        return fb.seq_lens + ndt, ext, start, mask

    # ---- forward ----------------------------------------------------------------------------------
    def forward_extend(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, **_kw: Any) -> Any:
        out = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        seq_lens, ext, start, mask = self.extend_metadata
        attention.extend_attention(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), k, v,
            out.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id), 1.0, 1.0,
            self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, seq_lens, ext, start,
            None, layer.scaling, layer.logit_cap, False, layer.sliding_window_size + 1, None, None, mask,
            True)
        return out

    def forward_decode(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, **_kw: Any) -> Any:
        if self.draft_decode_metadata is not None:
            req_to_token, seq_lens, req_pool_indices = self.draft_decode_metadata
        else:
            req_to_token = self.req_to_token_pool.req_to_token
            seq_lens, req_pool_indices = forward_batch.seq_lens, forward_batch.req_pool_indices
        q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
        out = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        store = save_kv_cache and k is not None and v is not None
        attention.decode_attention(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id), 1.0, 1.0,
            out.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            k if store else None, v if store else None, forward_batch.out_cache_loc, None,
            req_to_token, req_pool_indices, seq_lens, layer.scaling, layer.logit_cap, False,
            layer.sliding_window_size + 1, None, None)
        return out

    def support_triton(self) -> bool:
        return False


def _draft_blocks(custom_mask: torch.Tensor, seq_lens: torch.Tensor, ndt: int) -> torch.Tensor:
    """The release's verify tree mask (per request ``ndt`` rows of ``seq_len + ndt`` columns, the prefix
    all True) -> the draft-token blocks ``[bs * ndt * ndt]`` the testbed's extend attention reads."""
    blocks = []
    offset = 0
    for seq_len in seq_lens.tolist():
        width = int(seq_len) + ndt
        rows = custom_mask[offset: offset + ndt * width].view(ndt, width)
        blocks.append(rows[:, int(seq_len):].reshape(-1))
        offset += ndt * width
    return torch.cat(blocks).to(torch.bool)


class CpuMultiStepDraftBackend:
    """One :class:`CpuAttnBackend` per draft decode step (the last step runs no forward). Row
    ``b * topk + k`` of the expanded request table holds request b's prefix and branch k's draft
    slots, which the release's ``assign_draft_cache_locs`` put at ``seq_len + k * num_steps``."""

    def __init__(self, model_runner: Any, topk: int, speculative_num_steps: int) -> None:
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        backend = _backend_class()
        self.attn_backends = [backend(model_runner) for _ in range(speculative_num_steps - 1)]
        self.pool_len = model_runner.req_to_token_pool.req_to_token.shape[1]

    def init_forward_metadata(self, forward_batch: Any) -> None:
        table = speculative.build_draft_decode_metadata(
            self.attn_backends[0].req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
            forward_batch.seq_lens, self.topk, self.speculative_num_steps, self.pool_len)
        rows = torch.arange(table.shape[0], dtype=torch.int64)
        for step, backend in enumerate(self.attn_backends):
            seq_lens = forward_batch.seq_lens.repeat_interleave(self.topk) + step + 1
            backend.extend_metadata = None
            backend.draft_decode_metadata = (table, seq_lens, rows)


@functools.cache
def _backend_class() -> type:
    """:class:`CpuAttnBackend` with SGLang's ``AttentionBackend`` as base (its ``forward`` dispatch)."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    return type("CpuAttnBackend", (CpuAttnBackend, AttentionBackend), {"__module__": __name__})


# ---- patches (module name -> what to do right after SGLang imported it) -------------------------------
def _register_backend(module: ModuleType) -> None:
    module.ATTENTION_BACKENDS["intel_amx"] = lambda runner: _backend_class()(runner)


def _draft_factory(module: ModuleType) -> None:
    cls = module.DraftBackendFactory

    def chosen(factory: Any, name: str) -> str | None:
        args = factory.server_args
        return factory.draft_attn_backend or getattr(args, name, None) or args.attention_backend

    decode, extend = cls.create_decode_backend, cls.create_draft_extend_backend

    def create_decode_backend(self: Any) -> Any:
        if self.speculative_num_steps > 1 and chosen(self, "decode_attention_backend") == "intel_amx":
            return CpuMultiStepDraftBackend(self.draft_model_runner, self.topk, self.speculative_num_steps)
        return decode(self)

    def create_draft_extend_backend(self: Any) -> Any:
        name = ("decode_attention_backend" if self.server_args.speculative_attention_mode == "decode"
                else "prefill_attention_backend")
        if chosen(self, name) == "intel_amx":
            return _backend_class()(self.draft_model_runner)
        return extend(self)

    cls.create_decode_backend = create_decode_backend
    cls.create_draft_extend_backend = create_draft_extend_backend


def _tree_ops(module: ModuleType) -> None:
    module.sgl_build_tree_kernel_efficient = speculative.build_tree_kernel_efficient

    def verify_tree_greedy_func(predicts: Any, accept_index: Any, accept_token_num: Any, candidates: Any,
                                retrieve_index: Any, retrieve_next_token: Any, retrieve_next_sibling: Any,
                                target_predict: Any, topk: int = -1) -> Any:
        speculative.verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrieve_index,
                                       retrieve_next_token, retrieve_next_sibling, target_predict)
        return predicts, accept_index, accept_token_num

    module.verify_tree_greedy_func = verify_tree_greedy_func


def _keep_intel_amx(module: ModuleType) -> None:
    module.cpu_has_amx_support = lambda: True  # only server_args' own fallback check reads it there


def _no_cuda_sync_in_embed_sharing(module: ModuleType) -> None:
    cls = module.LlamaForCausalLM
    for name in ("set_embed", "set_embed_and_head"):
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(self: object, *args: object, _original: Callable[..., Any] = original) -> Any:
            saved = torch.cuda.synchronize
            torch.cuda.synchronize = lambda *_a, **_k: None
            try:
                return _original(self, *args)
            finally:
                torch.cuda.synchronize = saved

        setattr(cls, name, wrapper)


def _no_kv_copy_warmup(module: ModuleType) -> None:
    def init_kv_copy(self: Any) -> None:
        self._kv_copy_config = None

    module.MHATokenToKVPool._init_kv_copy_and_warmup = init_kv_copy


def _cpu_skips_record_stream(cls: type, name: str) -> None:
    """``cls.name`` with ``Tensor.record_stream`` doing nothing for CPU tensors while it runs."""
    original = getattr(cls, name)
    record_stream = torch.Tensor.record_stream

    def on_device_only(tensor: torch.Tensor, stream: Any) -> None:
        if tensor.device.type != "cpu":
            record_stream(tensor, stream)

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        torch.Tensor.record_stream = on_device_only
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.record_stream = record_stream

    setattr(cls, name, wrapper)


def _overlap_record_stream(method: str) -> Callable[[ModuleType], None]:
    def patch(module: ModuleType) -> None:
        _cpu_skips_record_stream(module.FutureMap, method)

    return patch


def _verify_record_stream(module: ModuleType) -> None:
    _cpu_skips_record_stream(module.EAGLEWorkerV2, "verify")


def _verify_cache_locs(module: ModuleType) -> None:
    original = module.assign_extend_cache_locs_func

    @functools.wraps(original)
    def assign_extend_cache_locs_func(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                      start_offset: torch.Tensor, end_offset: torch.Tensor, batch_size: int,
                                      draft_token_num: int, device: Any) -> torch.Tensor:
        if torch.device(device).type != "cpu":
            return original(req_pool_indices, req_to_token, start_offset, end_offset, batch_size,
                            draft_token_num, device)
        out_cache_loc = torch.empty((batch_size * draft_token_num,), dtype=torch.int64, device=device)
        module.assign_extend_cache_locs[(batch_size,)](
            req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, req_to_token.shape[1],
            module.next_power_of_2(batch_size))
        return out_cache_loc

    module.assign_extend_cache_locs_func = assign_extend_cache_locs_func


def patches(release: str) -> dict[str, Callable[[ModuleType], None]]:
    """Module name -> what to do right after SGLang imported it, for one of :data:`RELEASES`."""
    key = tuple(int(part) for part in release.split("."))
    from_0_5_13 = key >= (0, 5, 13)
    found: dict[str, Callable[[ModuleType], None]] = {
        "sglang.srt.managers.overlap_utils":
            _overlap_record_stream("_resolve_spec_extras" if from_0_5_13 else "resolve_future"),
        ("sglang.srt.speculative.triton_ops.cache_locs" if from_0_5_13
         else "sglang.srt.speculative.eagle_info_v2"): _verify_cache_locs,
        "sglang.srt.mem_cache.memory_pool": _no_kv_copy_warmup,
        "sglang.srt.layers.attention.attention_registry": _register_backend,
        "sglang.srt.speculative.draft_utils": _draft_factory,
        "sglang.srt.speculative.eagle_utils": _tree_ops,
        "sglang.srt.models.llama": _no_cuda_sync_in_embed_sharing,
    }
    if not from_0_5_13:
        found["sglang.srt.speculative.eagle_worker_v2"] = _verify_record_stream
    if key < (0, 5, 15):
        found["sglang.srt.server_args"] = _keep_intel_amx
    return found
