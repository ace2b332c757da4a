"""The engine-neutral middle of the tracer: the step path, the per-process tracer state and its
fail-safe guard, and the plugin's startup checks. Every engine adapter (``integrations/<engine>/``)
builds on it; it imports no engine."""
