"""Test infrastructure: a real Prometheus server and a real OTLP/HTTP receiver, as pytest fixtures
(`tests.infra.fixtures`, loaded from tests/conftest.py)."""
