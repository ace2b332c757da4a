"""Pure-torch versions of the sgl-kernel CPU ops that SGLang 0.5.23's EAGLE path calls on CPU,
registered as ``torch.ops.sgl_kernel.*`` by :func:`register_ops`.

Why registered under that namespace: SGLang's own code calls them there
(``IntelAMXAttnBackend`` reads ``torch.ops.sgl_kernel.decode_attention_cpu`` /
``extend_attention_cpu``) or imports them by name from the ``sgl_kernel`` module (the testbed's
stand-in module re-exports these ops). ``convert_weight_packed`` is deliberately NOT registered:
SGLang's ``cpu_has_amx_support()`` tests for it, and registering it would route ordinary layers to
AMX weight-packing kernels that do not exist here.
"""

from __future__ import annotations

import torch

from hs_tracer_testbed.runtime.kernels import attention, kvcache, speculative

NAMESPACE = "sgl_kernel"
AMX_PROBE_OP = "convert_weight_packed"

# name -> (schema without the name, implementation). Argument names follow SGLang's call sites
# (verify_tree_greedy_cpu is called with keywords, including the historical "retrive_*" spelling).
_OPS: dict[str, tuple[str, object]] = {
    "decode_attention_cpu": (
        "(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float key_scale, float value_scale, "
        "Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor attn_logits, "
        "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, "
        "bool is_cross_attention, int sliding_window, Tensor? encoder_lens, Tensor? sinks) -> ()",
        attention.decode_attention,
    ),
    "extend_attention_cpu": (
        "(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, Tensor k_buffer, "
        "Tensor v_buffer, float key_scale, float value_scale, Tensor req_to_token, Tensor req_pool_indices, "
        "Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, int? max_len_extend, "
        "float sm_scale, float logit_cap, bool is_cross_attention, int sliding_window, "
        "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()",
        attention.extend_attention,
    ),
    "build_draft_decode_metadata_cpu": (
        "(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int topk, int num_steps, "
        "int pool_len) -> Tensor",
        speculative.build_draft_decode_metadata,
    ),
    "assign_draft_cache_locs_contiguous_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor seq_lens, Tensor(a!) out_cache_loc, "
        "int pool_len, int topk, int num_steps) -> ()",
        speculative.assign_draft_cache_locs_contiguous,
    ),
    "assign_extend_cache_locs_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor(a!) out_cache_loc, int pool_len) -> ()",
        speculative.assign_extend_cache_locs,
    ),
    "assign_req_to_token_pool_cpu": (
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor out_cache_loc, int pool_len) -> ()",
        speculative.assign_req_to_token_pool,
    ),
    "fill_accept_out_cache_loc_cpu": (
        "(Tensor accept_index, Tensor out_cache_loc, Tensor(a!) accept_out_cache_loc) -> ()",
        speculative.fill_accept_out_cache_loc,
    ),
    "fill_bonus_tokens_cpu": (
        "(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens, int accept_stride) -> ()",
        speculative.fill_bonus_tokens,
    ),
    "build_tree_kernel_efficient_cpu": (
        "(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len, Tensor(a!) tree_mask, "
        "Tensor(b!) positions, Tensor(c!) retrive_index, Tensor(d!) retrive_next_token, "
        "Tensor(e!) retrive_next_sibling, int topk, int depth, int draft_token_num, "
        "int tree_mask_mode) -> ()",
        speculative.build_tree_kernel_efficient,
    ),
    "verify_tree_greedy_cpu": (
        "(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, Tensor candidates, "
        "Tensor retrive_index, Tensor retrive_next_token, Tensor retrive_next_sibling, "
        "Tensor target_predict) -> ()",
        speculative.verify_tree_greedy,
    ),
    "copy_all_layer_kv_cache_cpu": (
        "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
        kvcache.copy_all_layer_kv_cache,
    ),
}

OP_NAMES: tuple[str, ...] = tuple(_OPS)

_library: torch.library.Library | None = None


def register_ops() -> None:
    """Define and implement every op in ``OP_NAMES`` under ``torch.ops.sgl_kernel`` (CPU).
    Idempotent within a process. Refuses to run where a real sgl-kernel already defines them."""
    global _library
    if _library is not None:
        return
    existing = [name for name in OP_NAMES if hasattr(torch.ops.sgl_kernel, name)]
    if existing:
        raise RuntimeError(
            f"torch.ops.sgl_kernel already defines {existing}: a real sgl-kernel is loaded in this "
            "process; the testbed's pure-torch ops must not replace it (run the testbed without it)"
        )
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    for name, (schema, impl) in _OPS.items():
        lib.define(name + schema)
        lib.impl(name, impl, "CPU")
    _library = lib


def op(name: str):
    """The registered op ``torch.ops.sgl_kernel.<name>`` (registering first if needed)."""
    register_ops()
    return getattr(torch.ops.sgl_kernel, name)
