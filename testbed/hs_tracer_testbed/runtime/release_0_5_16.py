"""The CPU testbed's change for SGLang 0.5.16 to 0.5.19 (on top of :mod:`.patches`), never applied
by the production plugin: their ``IntelAMXAttnBackend`` calls the CPU attention ops with an older
argument list than the testbed's pure-torch ops take, which follow 0.5.20 on.

* ``extend_attention_cpu``: no ``key_scale``/``value_scale`` after the KV buffers, and (0.5.16 to
  0.5.18) no trailing ``is_causal``; ``decode_attention_cpu``: no ``key_scale``/``value_scale``.
  Without scales the KV buffers hold unscaled values (1.0); without ``is_causal``, causal.
* 0.5.16 to 0.5.18 pass ``forward_batch.seq_lens`` as the sequence lengths although the backend's
  own metadata holds others: a verify step's batch counts the lengths before its draft tokens
  (``_build_extend_metadata`` adds them), and a draft decode step's request table has one row per
  draft branch with ``seq_len + step + 1`` tokens (``draft_decode_metadata``). 0.5.19 passes its
  metadata's lengths; the adapter reads them there on every release of this module.

So each backend's two op attributes (set in its ``__init__``) become adapters onto the testbed's
ops with 0.5.20's argument list; the rest of the release's backend (metadata, KV writes, the
multi-step draft backend) runs as released.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from hs_tracer_testbed.runtime.kernels import op

RELEASES = ("0.5.16", "0.5.17", "0.5.18", "0.5.19")
ENV: dict[str, str] = {}
UNSCALED = 1.0


def _extend(backend: Any, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
            o: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
            req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
            extend_start_loc: torch.Tensor, max_len_extend: int | None, sm_scale: float, logit_cap: float,
            is_cross_attention: bool, sliding_window: int, encoder_lens: torch.Tensor | None,
            sinks: torch.Tensor | None, tree_mask: torch.Tensor | None, is_causal: bool = True) -> None:
    """The release's ``extend_attention_cpu`` call with 0.5.20's arguments and the lengths of the
    backend's extend metadata."""
    del seq_lens
    op("extend_attention_cpu")(
        q, k, v, o, k_buffer, v_buffer, UNSCALED, UNSCALED, req_to_token, req_pool_indices,
        backend.extend_metadata[0], extend_seq_lens, extend_start_loc, max_len_extend, sm_scale, logit_cap,
        is_cross_attention, sliding_window, encoder_lens, sinks, tree_mask, is_causal)


def _decode(backend: Any, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
            o: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, loc: torch.Tensor,
            attn_logits: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
            seq_lens: torch.Tensor, *rest: Any) -> None:
    """The release's ``decode_attention_cpu`` call with 0.5.20's arguments; in a draft decode step
    the lengths of the backend's expanded request table."""
    if backend.draft_decode_metadata is not None:
        seq_lens = backend.draft_decode_metadata[1]
    op("decode_attention_cpu")(q, k_buffer, v_buffer, UNSCALED, UNSCALED, o, k, v, loc, attn_logits,
                               req_to_token, req_pool_indices, seq_lens, *rest)


def _adapt_ops(module: ModuleType) -> None:
    cls = module.IntelAMXAttnBackend
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.extend_attention_fwd = functools.partial(_extend, self)
        self.decode_attention_fwd = functools.partial(_decode, self)

    cls.__init__ = __init__


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "sglang.srt.layers.attention.intel_amx_backend": _adapt_ops,
}
