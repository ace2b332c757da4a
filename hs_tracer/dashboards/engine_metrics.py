"""The serving engine's own metric names that the dashboard and the presence alert read.

Why here: hs_tracer's metrics judge the draft; whether speculation pays off shows in the engine's
own throughput and latency ("speculation slower than none"), and a replica whose engine metrics are
scraped without hs_tracer's is one where the plugin did not load. SGLang writes these with
``--enable-metrics`` (``sglang/srt/observability/metrics_collector.py``; tests/test_dashboards.py
checks each name against the installed release). Their labels are SGLang's (``model_name``,
``tp_rank``, ...), not hs_tracer's ``model``: queries select them by job and instance only, and by
either spelling of the name (:func:`sel`).
"""

from __future__ import annotations

SGLANG_RUNNING_REQS = "sglang:num_running_reqs"  # gauge, per scheduler: requests being decoded
SGLANG_GEN_THROUGHPUT = "sglang:gen_throughput"  # gauge, per scheduler: generated tokens/s, last interval
SGLANG_GENERATION_TOKENS = "sglang:generation_tokens_total"  # counter: generated tokens
SGLANG_TTFT = "sglang:time_to_first_token_seconds"  # histogram: time to first token per request
SGLANG_ITL = "sglang:inter_token_latency_seconds"  # histogram: time between output tokens
SGLANG_E2E = "sglang:e2e_request_latency_seconds"  # histogram: request latency, end to end
SGLANG_SPEC_ACCEPT_LENGTH = "sglang:spec_accept_length"  # gauge: SGLang's own mean accept length

SGLANG_METRICS = (SGLANG_RUNNING_REQS, SGLANG_GEN_THROUGHPUT, SGLANG_GENERATION_TOKENS, SGLANG_TTFT,
                  SGLANG_ITL, SGLANG_E2E, SGLANG_SPEC_ACCEPT_LENGTH)

ENGINE_SELECTOR = 'job=~"$job", instance=~"$instance"'
"""Matchers of an engine query on the dashboard (its series carry no hs_tracer ``model`` label)."""


def sel(name: str, selector: str = ENGINE_SELECTOR) -> str:
    """A selector for SGLang's series ``name`` under either spelling it reaches Prometheus with:
    ``sglang:...`` in the text format, ``sglang_...`` where prometheus_client answers a scrape that
    asks for OpenMetrics (it escapes the colon; Prometheus 2.x asks for OpenMetrics first)."""
    pattern = name.replace(":", "[:_]")
    return "{" + ", ".join(part for part in (f'__name__=~"{pattern}"', selector) if part) + "}"
