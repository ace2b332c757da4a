"""Expected acceptance: what the draft reaches on its own training distribution, measured at build time.

Why: a live accept length means nothing without a reference. A draft fed the right features but
mapping its tokens wrong, or a prompt mix far from training, shows only in acceptance; comparing
with what the same draft reaches on its training data turns "mean accept length 1.0" into "far
below the 3.2 this draft reaches on its training data".

Method (greedy chain, top-k 1, the way SGLang's EAGLE-3 chain drafts): for every row ``p`` of a
training sequence, draft-extend runs over the recorded features with the next token ``ids[p+1]``
and predicts ``ids[p+2]``; each further draft step feeds the draft its own recurrent hidden and its
own previous token at position ``p+s`` and attends to the extend context ``0..p`` plus its own chain
(what SGLang's draft KV cache holds). Draft position ``s`` counts as accepted when positions
``0..s`` all equal the data's tokens: the target's next tokens in the training data (SpecForge and
speculators regenerate responses with the target). Rates are cumulative, as a live accept length
counts them: ``mean accept length = 1 + sum(per_position_rate)``. Where the dump has a loss mask (SpecForge),
only rows whose token ``p+1`` is a response token count: live decoding drafts responses, never the
prompt (on the real pair's held-out records the prompt rows pull 2.66 down to 2.31).

The profile also keeps the training data's own vocabulary map (SpecForge ``vocab_mapping.pt``) as
a digest, so ``hs-tracer check --profile`` can tell a ``d2t`` that was regenerated after training.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

METHOD = (
    "greedy chain (top-k 1) of the plain-torch draft on the training data: draft-extend on the recorded "
    "features, then the draft's own hidden and tokens; position s accepted when positions 0..s equal "
    "the data's next tokens"
)
DEFAULT_SEQUENCES = 64
DEFAULT_STEPS = 3
_QUERY_CHUNK = 256  # query rows per attention block: bounds memory at [chunk, steps * T]


@dataclass
class ExpectedAcceptance:
    """Per-position cumulative acceptance of the draft on its training data, with provenance."""

    per_position_rate: list[float]
    rows: int  # draft-extend rows measured (one per position with num_steps following tokens)
    sequences: int
    num_steps: int
    draft: str
    draft_config_sha256: str
    d2t_sha256: str | None
    draft_flags: dict[str, bool] | None = None  # normalisation flags of the draft config measured
    method: str = METHOD
    data: str = "training"  # what it was measured on: "training" (the profiled dump) or "held-out"

    @property
    def mean_accept_length(self) -> float:
        return 1.0 + float(sum(self.per_position_rate))

    def accept_length(self, positions: int) -> float:
        """Expected mean accept length when the engine drafts ``positions`` tokens per step."""
        return 1.0 + float(sum(self.per_position_rate[:positions]))

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["mean_accept_length"] = round(self.mean_accept_length, 4)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ExpectedAcceptance:
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**fields)


def of_profile(meta: dict[str, Any]) -> ExpectedAcceptance | None:
    """The expectation a profile's metadata carries, if it was measured."""
    raw = meta.get("expected_acceptance")
    return ExpectedAcceptance.from_json(raw) if raw else None


def merge(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Shards measure the same evenly spread sample of the whole dump: keep it when both shards
    measured the same draft, drop it when they disagree."""
    if not a or not b:
        return None
    keys = ("draft_config_sha256", "d2t_sha256", "num_steps", "rows")
    return a if all(a.get(k) == b.get(k) for k in keys) else None


def digest(values: np.ndarray | None) -> str | None:
    """sha256 of an int64 vector (d2t); the same map always hashes the same."""
    if values is None:
        return None
    return hashlib.sha256(np.ascontiguousarray(np.asarray(values, dtype=np.int64)).tobytes()).hexdigest()


def training_vocab_map(root: str | Path) -> dict[str, Any] | None:
    """SpecForge's ``vocab_mapping/vocab_mapping.pt`` next to (or under) a dump: the d2t the draft's
    lm_head was trained with. Loaded with ``weights_only=True`` (plain tensors only)."""
    import torch

    root = Path(root)
    for base in (root, root.parent):
        cand = base / "vocab_mapping" / "vocab_mapping.pt"
        if cand.is_file():
            try:
                data = torch.load(cand, weights_only=True, map_location="cpu")
            except Exception:
                return None
            if isinstance(data, dict) and "d2t" in data:
                d2t = data["d2t"].numpy()
                return {"path": str(cand), "draft_vocab": int(d2t.shape[0]), "d2t_sha256": digest(d2t)}
    return None


# --------------------------------------------------------------------------------------------------
# Training sequences: (features [T, K*H] float32, token ids [T], loss mask [T] or None)
# --------------------------------------------------------------------------------------------------

def training_sequences(root: str | Path, limit: int
                       ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:  # fmt: skip
    """Up to ``limit`` sequences spread evenly over a SpecForge or speculators dump (sorted files):
    features, token ids and, where the dump has one, the loss mask (1 on the response tokens)."""
    from hs_tracer.profile import readers

    reader = readers.detect(root)
    files = reader.files()
    step = max(len(files) // max(limit, 1), 1)
    for file in files[::step][:limit]:
        if isinstance(reader, readers.SpecForgeReader):
            data = reader.load(file)
            aux = data["aux_hidden_state"]
            aux = aux[0] if aux.dim() == 3 else aux
            ids = data["input_ids"].reshape(-1)
            mask = data.get("loss_mask")
            mask = mask.reshape(-1).numpy() if mask is not None and mask.numel() == ids.numel() else None
            yield aux.float().numpy(), ids.numpy().astype(np.int64), mask
        elif isinstance(reader, readers.SpeculatorsReader):
            hs, _final, ids = reader.load(file)
            if ids is None:
                return
            t, layers, _h = hs.shape
            yield hs[:, : layers - 1].reshape(t, -1).float().numpy(), ids.astype(np.int64), None
        else:
            return  # captures are live features, not training data


# --------------------------------------------------------------------------------------------------
# The measurement
# --------------------------------------------------------------------------------------------------

def chain_accepted(draft, feats, ids, num_steps: int):
    """``[R, num_steps]`` bool: draft position s accepted at row p (rows p = 0..T-2-num_steps)."""
    import torch

    t = int(ids.shape[0])
    rows = t - 1 - num_steps
    if rows <= 0:
        return torch.zeros(0, num_steps, dtype=torch.bool)
    tokens = torch.cat([ids[1:], ids[-1:]])  # row p gets ids[p+1]; the last row's token is unused
    positions = torch.arange(t)
    hidden = draft.project(feats)
    q0, k0, v0, res0 = draft.qkv(hidden, tokens, positions)
    mask0 = torch.ones(t, t, dtype=torch.bool).tril()
    out = draft.finish(draft.attend(q0, k0, v0, mask0), res0)
    pred = draft.to_target_ids(out.logits.argmax(-1))
    preds, h_prev = [pred], out.hidden
    keys, vals = [], []
    for s in range(1, num_steps):
        q, k, v, res = draft.qkv(h_prev, pred, positions + s)
        keys.append(k)
        vals.append(v)
        attn = []
        for a in range(0, t, _QUERY_CHUNK):
            b = min(a + _QUERY_CHUNK, t)
            kk = torch.cat([k0[:b], *[kr[a:b] for kr in keys]])
            vv = torch.cat([v0[:b], *[vr[a:b] for vr in vals]])
            m = torch.zeros(b - a, b + s * (b - a), dtype=torch.bool)
            m[:, :b] = torch.ones(b, b, dtype=torch.bool).tril()[a:b]
            eye = torch.eye(b - a, dtype=torch.bool)
            for r in range(s):
                m[:, b + r * (b - a): b + (r + 1) * (b - a)] = eye
            attn.append(draft.attend(q[a:b], kk, vv, m))
        out = draft.finish(torch.cat(attn), res)
        pred = draft.to_target_ids(out.logits.argmax(-1))
        preds.append(pred)
        h_prev = out.hidden
    hits = torch.stack([preds[s][:rows] == ids[2 + s: 2 + s + rows] for s in range(num_steps)], dim=1)
    return hits.cumprod(dim=1).bool()


def measure(
    draft_dir: str | Path,
    target_dir: str | Path,
    data: Sequence[str | Path],
    *,
    sequences: int = DEFAULT_SEQUENCES,
    num_steps: int = DEFAULT_STEPS,
    skip_first: int = 1,
) -> ExpectedAcceptance | None:
    """Run the draft on up to ``sequences`` training sequences; None if the data holds no token ids."""
    import torch

    from hs_tracer.draft.model import Eagle3Draft

    draft_dir = Path(draft_dir)
    draft = Eagle3Draft.from_pretrained(draft_dir, target_dir=target_dir).eval()  # ValueError: unusable
    accepted = torch.zeros(num_steps, dtype=torch.long)
    rows = seqs = 0
    with torch.no_grad():
        for root in data:
            for feats, ids, mask in training_sequences(root, sequences - seqs):
                hits = chain_accepted(draft, torch.from_numpy(feats), torch.from_numpy(ids), num_steps)
                hits = hits[skip_first:]  # row p drafts after token p + 1
                if mask is not None:  # only rows that draft a response, as live decoding does
                    hits = hits[torch.from_numpy(mask[1 + skip_first : 1 + skip_first + hits.shape[0]] > 0)]
                accepted += hits.sum(0)
                rows += int(hits.shape[0])
                seqs += 1
            if seqs >= sequences:
                break
    if rows == 0:
        return None
    from hs_tracer.draft.norm_flags import written_flags

    cfg = (draft_dir / "config.json").read_bytes()
    d2t = draft.d2t.numpy() if draft.config.draft_vocab_size != draft.config.vocab_size else None
    return ExpectedAcceptance(
        per_position_rate=[round(float(a) / rows, 6) for a in accepted],
        rows=rows,
        sequences=seqs,
        num_steps=num_steps,
        draft=str(draft_dir),
        draft_config_sha256=hashlib.sha256(json.dumps(json.loads(cfg), sort_keys=True).encode()).hexdigest(),
        d2t_sha256=digest(d2t),
        draft_flags=written_flags(json.loads(cfg)),
    )


def measure_or_note(draft_dir: str | Path, target_dir: str | Path, data: Sequence[str | Path], *,
                    sequences: int = DEFAULT_SEQUENCES, held_out: bool = False) -> dict[str, Any] | None:
    """:func:`measure` for ``profile build``: the expectation as JSON, or None with one line on stderr
    saying why it was not measured (the profile is still useful without it). ``held_out``: ``data``
    is data of the training domain the draft was not trained on."""
    import sys

    try:
        exp = measure(draft_dir, target_dir, data, sequences=sequences)
        if exp is not None and held_out:
            exp.data = "held-out"
    except (ValueError, FileNotFoundError, NotImplementedError, KeyError) as exc:
        print(f"expected acceptance not measured: {exc}", file=sys.stderr)
        return None
    if exp is None:
        print("expected acceptance not measured: the data holds no token ids", file=sys.stderr)
        return None
    return exp.to_json()
