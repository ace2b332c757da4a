"""``--server-args``: the SGLang command line whose speculative flags ``check`` resolves.

A flag SGLang does not know (``--speculative-num-stepz``), a value its parser or its startup refuses
(``--speculative-num-steps 0``, an algorithm that is not EAGLE) or a command line without
``--speculative-algorithm`` is an input error: SGLang would not start with it, so no verdict about it
can be right.
"""

from __future__ import annotations

import difflib
import shlex
from typing import Any

from hs_tracer import engines
from hs_tracer.errors import InputError

FLAG = "--server-args"
# The algorithms whose draft hs-tracer checks (NEXTN is SGLang's alias of EAGLE).
ALGORITHMS = ("EAGLE3", "EAGLE", "NEXTN")
# Every --speculative-* flag of the newest supported SGLang release's server (tests compare this
# with the installed parser).
SGLANG_SPECULATIVE_FLAGS = frozenset({
    "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-draft-model",
    "--speculative-draft-model-revision", "--speculative-draft-load-format", "--speculative-num-steps",
    "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--speculative-dflash-block-size",
    "--speculative-dspark-block-size", "--speculative-dspark-sps-table-path",
    "--speculative-dspark-confidence-sts-path", "--speculative-dspark-align-verify-tokens-to-graph-tier",
    "--speculative-accept-threshold-single", "--speculative-accept-threshold-acc",
    "--speculative-use-rejection-sampling", "--speculative-token-map", "--speculative-attention-mode",
    "--speculative-draft-attention-backend", "--speculative-dsa-topk-backend",
    "--speculative-draft-kv-cache-dtype", "--speculative-draft-window-size",
    "--speculative-moe-runner-backend", "--speculative-moe-a2a-backend",
    "--speculative-enable-w4a4-mxfp4-megamoe", "--no-speculative-enable-w4a4-mxfp4-megamoe",
    "--speculative-draft-model-quantization", "--speculative-adaptive", "--speculative-adaptive-config",
    "--speculative-ngram-min-bfs-breadth", "--speculative-ngram-max-bfs-breadth",
    "--speculative-ngram-match-type", "--speculative-ngram-max-trie-depth", "--speculative-ngram-capacity",
    "--speculative-ngram-external-corpus-path", "--speculative-ngram-external-sam-budget",
    "--speculative-ngram-external-corpus-max-tokens", "--speculative-domino-candidate-pool-size",
    "--speculative-use-block-verification", "--speculative-draft-sink-size",
})
_POSITIVE = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")


def _known(flag: str) -> bool:
    """Exact, or an unambiguous prefix (SGLang's argparse accepts abbreviations)."""
    if flag in SGLANG_SPECULATIVE_FLAGS:
        return True
    return sum(f.startswith(flag) for f in SGLANG_SPECULATIVE_FLAGS) == 1


def check_server_args(text: str) -> dict[str, Any]:
    """The speculative flags of ``text`` (as :func:`~hs_tracer.preflight.spec_args.parse_server_args`
    returns them), after refusing what SGLang would refuse."""
    from hs_tracer.preflight.spec_args import ServerArgsError, parse_server_args

    fix = ("pass the server's command line, e.g. \"--speculative-algorithm EAGLE3 --speculative-num-steps 3 "
           "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4\"")
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise InputError(FLAG, f"cannot be split into words ({exc})", fix) from None
    for word in words:
        flag = word.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        if flag.startswith(("--speculative", "--no-speculative")) and not _known(flag):
            near = difflib.get_close_matches(flag, sorted(SGLANG_SPECULATIVE_FLAGS), n=1)
            raise InputError(FLAG, f"SGLang {engines.newest_release()} has no flag {flag}",
                             f"did you mean {near[0]}?" if near else fix)
        if flag not in SGLANG_SPECULATIVE_FLAGS and not flag.startswith("--speculative"):
            near = difflib.get_close_matches(flag, sorted(SGLANG_SPECULATIVE_FLAGS), n=1, cutoff=0.85)
            if near:
                raise InputError(FLAG, f"SGLang {engines.newest_release()} has no flag {flag}",
                                 f"did you mean {near[0]}?")
    try:
        parsed = parse_server_args(text)
    except ServerArgsError as exc:
        raise InputError(FLAG, str(exc), fix) from None
    algo = parsed.get("speculative_algorithm")
    if algo is None:
        raise InputError(FLAG, "no --speculative-algorithm: SGLang would serve without speculative decoding",
                         "add --speculative-algorithm EAGLE3")
    if algo.upper() not in ALGORITHMS:
        raise InputError(FLAG, f"--speculative-algorithm {algo} does not run an EAGLE draft",
                         f"use one of {', '.join(ALGORITHMS)} (hs-tracer checks EAGLE-3 drafts)")
    for name in _POSITIVE:
        value = parsed.get(name)
        if value is not None and value < 1:
            raise InputError(FLAG, f"--{name.replace('_', '-')} {value}: SGLang needs a positive value",
                             fix)
    return parsed
