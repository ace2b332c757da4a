"""CPU runtime for the hs_tracer testbed: what it takes to run SGLang 0.5.23 (plain decoding and
EAGLE-3) on a machine without a GPU. Applied only through :mod:`.launcher`, never by importing
hs_tracer in production. Importing this package is cheap (no torch, no SGLang): the
``sitecustomize`` hook imports it in every SGLang process the launcher starts.

Entry points: :func:`hs_tracer_testbed.runtime.launcher.start_engine` and
:func:`hs_tracer_testbed.runtime.launcher.engine`.
"""
