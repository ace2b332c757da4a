"""hs_tracer inside SGLang: the plugin (``sglang.srt.plugins``), its version guard and its hooks."""

NAME = "sglang"  # the registry name (hs_tracer.engines), the ``engine`` of its records
