"""Speculative server arguments: the values SGLang will really use, and what it rejects.

:func:`resolve_spec_args` mirrors ``sglang/srt/arg_groups/speculative_hook.py`` of the newest supported
release: ``_resolve_speculative_algorithm_alias`` (NEXTN -> EAGLE), ``_handle_eagle_family`` (the assertion
when topk / draft tokens are set without steps, ``_auto_choose_speculative_params`` by target
architecture, topk == 1 forcing ``num_draft_tokens = num_steps + 1``, rejection sampling needing
topk 1) and ``_init_adaptive_speculative_params``; plus the runtime limit in
``speculative/eagle_utils.py::organize_draft_results`` (``torch.topk`` over
``topk + (num_steps - 1) * topk**2`` candidates). :func:`resolve_with_sglang` runs SGLang's own
resolution pipeline instead (needs SGLang installed; CPU is enough, about half a minute);
tests/test_check_spec_args.py checks the mirror against it.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hs_tracer import engines
from hs_tracer.errors import InputError
from hs_tracer.findings import Code, Finding, Severity

# _auto_choose_speculative_params: (steps, topk, draft tokens) by target architecture.
_AUTO_5_4_8 = frozenset({"LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM"})
_AUTO_DEFAULT = (3, 1, 4)

SPEC_FIELDS = ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
               "speculative_num_draft_tokens", "speculative_adaptive", "speculative_use_rejection_sampling")


class ServerArgsError(InputError):
    """The --server-args string cannot be parsed."""


def parse_server_args(text: str) -> dict[str, Any]:
    """The speculative flags of an ``sglang.launch_server`` command line; other flags are ignored."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--speculative-algorithm", dest="speculative_algorithm")
    parser.add_argument("--speculative-num-steps", dest="speculative_num_steps", type=int)
    parser.add_argument("--speculative-eagle-topk", dest="speculative_eagle_topk", type=int)
    parser.add_argument("--speculative-num-draft-tokens", dest="speculative_num_draft_tokens", type=int)
    parser.add_argument("--speculative-adaptive", dest="speculative_adaptive", action="store_true")
    parser.add_argument("--speculative-use-rejection-sampling", dest="speculative_use_rejection_sampling",
                        action="store_true")
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ServerArgsError(f"cannot split --server-args: {exc}") from exc
    # `python -m sglang.launch_server ...` or `sglang serve ...` pasted whole: keep only the flags
    while words and not words[0].startswith("--"):
        words.pop(0)
    try:
        ns, _ = parser.parse_known_args(words)
    except SystemExit as exc:  # argparse exits on a bad int
        raise ServerArgsError(f"cannot parse the speculative flags in --server-args: {text!r}") from exc
    return vars(ns)


@dataclass
class SpecResolution:
    """Requested vs used values; ``rejected`` is SGLang's refusal (startup or first decode)."""

    requested: dict[str, Any]
    algorithm: str | None
    num_steps: int | None = None
    topk: int | None = None
    num_draft_tokens: int | None = None
    adjusted: list[tuple[str, Any, Any, str]] = field(default_factory=list)  # field, from, to, why
    rejected: str | None = None
    method: str = field(
        default_factory=lambda: f"hs_tracer's copy of SGLang {engines.newest_release()}'s rules")

    def used(self) -> dict[str, Any]:
        return {"speculative_algorithm": self.algorithm, "speculative_num_steps": self.num_steps,
                "speculative_eagle_topk": self.topk, "speculative_num_draft_tokens": self.num_draft_tokens}


def auto_params(target_arch: str) -> tuple[int, int, int]:
    return (5, 4, 8) if target_arch in _AUTO_5_4_8 else _AUTO_DEFAULT


def resolve_spec_args(requested: dict[str, Any], target_arch: str) -> SpecResolution:
    """What the newest supported SGLang release makes of the requested speculative flags on this target."""
    algo = requested.get("speculative_algorithm")
    algo = algo.upper() if isinstance(algo, str) else None
    if algo == "NEXTN":
        algo = "EAGLE"
    res = SpecResolution(requested=dict(requested), algorithm=algo)
    if algo not in ("EAGLE", "EAGLE3"):
        return res
    steps = requested.get("speculative_num_steps")
    topk = requested.get("speculative_eagle_topk")
    tokens = requested.get("speculative_num_draft_tokens")
    if requested.get("speculative_adaptive"):
        # _init_adaptive_speculative_params: topk defaults to 1, draft tokens = steps + 1; steps
        # come from the adaptive config's candidate list (not known here).
        if topk is None:
            res.adjusted.append(("speculative_eagle_topk", None, 1, "adaptive speculation default"))
            topk = 1
        if steps is not None and tokens != steps + 1:
            res.adjusted.append(("speculative_num_draft_tokens", tokens, steps + 1,
                                 "adaptive speculation uses num_steps + 1"))
            tokens = steps + 1
        res.num_steps, res.topk, res.num_draft_tokens = steps, topk, tokens
        return res
    if steps is None:
        if topk is not None or tokens is not None:
            res.rejected = ("SGLang asserts at startup: --speculative-eagle-topk / "
                            "--speculative-num-draft-tokens need --speculative-num-steps "
                            "(otherwise all three are chosen automatically)")
            return res
        steps, topk, tokens = auto_params(target_arch)
        res.adjusted.append(("speculative_num_steps/eagle_topk/num_draft_tokens", None,
                             (steps, topk, tokens),
                             f"chosen automatically for {target_arch or 'this target'}"))
    if requested.get("speculative_use_rejection_sampling") and topk != 1:
        res.rejected = "--speculative-use-rejection-sampling requires --speculative-eagle-topk 1"
    elif topk is None:
        res.rejected = ("--speculative-num-steps without --speculative-eagle-topk: SGLang's startup fails "
                        "comparing the unset topk (TypeError: None > 1)")
    if topk == 1 and tokens != steps + 1:
        res.adjusted.append(("speculative_num_draft_tokens", tokens, steps + 1,
                             "SGLang sets num_draft_tokens = num_steps + 1 when topk == 1"))
        tokens = steps + 1
    res.num_steps, res.topk, res.num_draft_tokens = steps, topk, tokens
    if res.rejected is None and topk is not None and topk > 1 and tokens is None:
        res.rejected = ("--speculative-num-draft-tokens unset with topk > 1: SGLang leaves it None and the "
                        "EAGLE worker fails on it at startup (eagle_worker_v2 sizes buffers with it)")
    if res.rejected is None and topk is not None and topk > 1 and tokens is not None:
        candidates = topk + (steps - 1) * topk * topk
        if tokens - 1 > candidates:
            res.rejected = (f"num_draft_tokens - 1 = {tokens - 1} exceeds the {candidates} draft candidates "
                            f"of steps={steps}, topk={topk}: torch.topk in organize_draft_results raises at "
                            "the first decode (CUDA graph capture)")
    return res


def spec_findings(res: SpecResolution) -> list[Finding]:
    """One finding per adjustment, and a critical one when SGLang will refuse the combination."""
    findings = []
    requested = {k: res.requested.get(k) for k in SPEC_FIELDS if res.requested.get(k) is not None}
    details = {"requested": requested,
               "used": res.used(), "method": res.method}
    if res.rejected:
        findings.append(Finding(
            Code.SPEC_ARGS_ADJUSTED, Severity.CRITICAL,
            f"SGLang will refuse these speculative args: {res.rejected}",
            "pass --speculative-num-steps, --speculative-eagle-topk and --speculative-num-draft-tokens "
            "together (topk 1: draft tokens = steps + 1; topk k: draft tokens - 1 <= k + (steps-1)*k^2)",
            details=details))
    for name, old, new, why in res.adjusted:
        automatic = old is None
        findings.append(Finding(
            Code.SPEC_ARGS_ADJUSTED, Severity.INFO if automatic else Severity.WARNING,
            f"{name}: {'not set' if automatic else old} -> {new} ({why}); the server will run with "
            f"steps={res.num_steps}, topk={res.topk}, draft tokens={res.num_draft_tokens}, so the longest "
            f"accept length is {res.num_steps + 1 if res.num_steps else '?'}",
            "" if automatic else
            "pass the value SGLang will use, so dashboards and benchmarks match the config",
            expected=str(old) if old is not None else None, observed=str(new), details=details))
    return findings


def resolve_with_sglang(requested: dict[str, Any], target_dir: Path, draft_dir: Path) -> SpecResolution:
    """Run the installed SGLang's own server-args resolution on CPU for the speculative flags only.

    Raises ImportError when SGLang is not installed. A refusal (AssertionError/ValueError from its
    handlers) is returned as ``rejected``.
    """
    from sglang.srt.server_args import ServerArgs

    kwargs = {k: v for k, v in requested.items() if v not in (None, False)}
    algo = kwargs.get("speculative_algorithm")
    res = SpecResolution(requested=dict(requested), algorithm=algo.upper() if algo else None,
                         method="sglang resolution pipeline")
    try:
        sa = ServerArgs(model_path=str(target_dir), speculative_draft_model_path=str(draft_dir),
                        device="cpu", **kwargs)
        sa.resolve_once()
        used = sa.resolved_dict()
    except (AssertionError, ValueError, NotImplementedError, TypeError) as exc:
        # TypeError: e.g. steps without topk reaches `None > 1` in _handle_eagle_family
        res.rejected = f"{type(exc).__name__}: {exc}".rstrip(": ")
        return res
    res.algorithm = used.get("speculative_algorithm")
    res.num_steps = used.get("speculative_num_steps")
    res.topk = used.get("speculative_eagle_topk")
    res.num_draft_tokens = used.get("speculative_num_draft_tokens")
    for name, value in (("speculative_num_steps", res.num_steps), ("speculative_eagle_topk", res.topk),
                        ("speculative_num_draft_tokens", res.num_draft_tokens)):
        if requested.get(name) != value:
            res.adjusted.append((name, requested.get(name), value, "SGLang's resolution"))
    return res
