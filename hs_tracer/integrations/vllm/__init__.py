"""hs_tracer inside vLLM: the plugin (``vllm.general_plugins``), its version guard and its hooks."""

NAME = "vllm"  # the registry name (hs_tracer.engines), the ``engine`` of its records
