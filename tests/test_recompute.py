"""Recomputing a target on a dump's tokens, on a tiny random Llama (seconds): which rows are whole
sequences, how the sample is bounded, and that every slot is named from the rows, not the record."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hs_tracer.diagnosis.recompute import measure, trained_sources, training_findings
from hs_tracer.errors import InputError
from hs_tracer.findings import Code, Severity
from hs_tracer.profile.readers import Record
from hs_tracer.profile.target_forward import load_target
from hs_tracer.profile.token_rows import NO_IDS, PREFIX_NOT_HELD, Sample, TokenRows, sample, sequences_of


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(out)  # safetensors
    return out


def _record(lengths: list[int], starts: list[int], *, extend_lens: bool = True) -> Record:
    pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
    t = len(pos)
    return Record("shard:0", torch.arange(t * 2 * 3, dtype=torch.float32).reshape(t, 2, 3), positions=pos,
                  input_ids=np.arange(100, 100 + t), extend_lens=np.array(lengths) if extend_lens else None)


@pytest.mark.parametrize("extend_lens", [True, False])
def test_a_capture_shard_splits_into_requests_and_leaves_out_those_with_a_prefix(extend_lens: bool) -> None:
    rec = _record([5, 6, 4], [0, 0, 3], extend_lens=extend_lens)
    seqs, left = sequences_of(rec, skip_first=1)
    assert left == {PREFIX_NOT_HELD: 1}
    assert [s.positions.tolist() for s in seqs] == [[1, 2, 3, 4], [1, 2, 3, 4, 5]]
    assert seqs[1].input_ids.tolist() == list(range(105, 111))  # the whole request, position 0 included
    torch.testing.assert_close(seqs[1].rows, rec.slots[6:11])


def test_back_to_back_requests_of_one_length_split_by_extend_lens_only() -> None:
    """Positions alone cannot split [0..3][4..7] from one request [0..7]; extend_lens can."""
    rec = _record([4, 4], [0, 4])
    assert sequences_of(rec, 1)[1] == {PREFIX_NOT_HELD: 1}
    rec.extend_lens = None
    assert len(sequences_of(rec, 1)[0]) == 1


def test_rows_without_token_ids_are_counted_not_compared() -> None:
    rec = _record([5], [0])
    rec.input_ids = None
    assert sequences_of(rec, 1) == ([], {NO_IDS: 1})


def test_the_sample_is_bounded_and_cuts_the_last_sequence_with_its_tokens() -> None:
    files = [Path(f"f{i}") for i in range(4)]
    out = sample(files, lambda f: [_record([10], [0])], sequences=8, tokens=12, skip_first=1)
    assert [len(s.positions) for s in out.sequences] == [9, 3] and out.rows == 12
    assert len(out.sequences[1].input_ids) == 4  # positions 0..3: rows never need later tokens


def _fed(target, seqs: list[list[int]], fed: list[str]) -> Sample:
    out = Sample()
    for i, ids in enumerate(seqs):
        states = target.states(ids)
        rows = torch.stack([states[s][1:] for s in fed], dim=1).to(torch.bfloat16)
        out.sequences.append(TokenRows(f"s{i}", np.array(ids), rows, np.arange(1, len(ids))))
    return out


def test_every_slot_is_named_from_its_rows(tiny: Path) -> None:
    target = load_target(tiny)
    assert target.sources == ["embedding", "block:0", "block:1", "block:2", "block:3", "final_norm"]
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 64, 24).tolist() for _ in range(3)]
    fed = ["block:2", "embedding", "final_norm"]
    m = measure(target, _fed(target, seqs, fed), "bfloat16", progress=False)
    assert m.sources == fed and m.rows == 69 and m.tolerance == 0.06
    assert all(s.error < 0.01 and s.runner_up_error > 0.1 for s in m.slots)

    stated = ["block:2", "block:1", "final_norm"]
    findings = training_findings(m.slots, stated, {"layer_ids": [2, 1, 4], "convention": "specforge"})
    assert [(f.code, f.severity, f.slot, f.expected, f.observed) for f in findings] == [
        (Code.TRAINING_RECORD_MISMATCH, Severity.CRITICAL, 1, "block:1", "embedding")]
    assert trained_sources(m.slots, stated) == fed


def test_rows_of_another_width_than_the_target_are_an_input_error(tiny: Path) -> None:
    target = load_target(tiny)
    wide = Sample([TokenRows("s", np.arange(4), torch.zeros(3, 1, 48), np.arange(1, 4))])
    with pytest.raises(InputError, match="hidden size 32"):
        measure(target, wide, "bfloat16", progress=False)


def test_token_ids_beyond_the_vocabulary_are_an_input_error(tiny: Path) -> None:
    target = load_target(tiny)
    other = Sample([TokenRows("s", np.array([1, 2, 100, 3]), torch.zeros(3, 1, 32), np.arange(1, 4))])
    with pytest.raises(InputError, match="token id 100, beyond its vocabulary of 64"):
        measure(target, other, "bfloat16", progress=False)


def test_non_finite_rows_are_left_out_of_the_comparison(tiny: Path) -> None:
    target = load_target(tiny)
    fed = ["block:1", "block:3"]
    s = _fed(target, [list(range(5, 25))], fed)
    s.sequences[0].rows[4, 1, 7] = float("nan")
    m = measure(target, s, "bfloat16", progress=False)
    assert m.sources == fed and [x.rows for x in m.slots] == [18, 18]
