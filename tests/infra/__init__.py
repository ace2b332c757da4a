"""Test infrastructure: a real Prometheus server and a real OTLP/HTTP receiver.

Fixtures (pytest plugin ``tests.infra.fixtures``): ``prometheus_factory(targets) -> PrometheusServer``
(``.query/.vector/.value`` run PromQL, ``.wait_for_scrape(t)`` waits for a scrape that started after
``t``), ``otlp_receiver`` / ``otlp_receiver_factory(hold/delay_s/status)`` (``.endpoint``,
``.spans(name)``, ``.wait_for_spans(n, name)``), ``free_port``. ``steps.make_steps`` makes
deterministic step records. ``prometheus.sh`` installs Debian's prometheus package if missing.
"""
