"""hs_tracer inside vLLM: the plugin (``vllm.general_plugins``), its version guard and its hooks."""
