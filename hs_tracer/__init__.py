"""hs_tracer: find EAGLE-3 draft/target hidden-state wiring mismatches in live SGLang deployments.

Importing this package is cheap on purpose: SGLang imports the plugin entry point in every process,
and with ``HS_TRACER`` unset nothing else of hs_tracer may be loaded.
"""

__version__ = "0.1.0"
