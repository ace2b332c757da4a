"""The static configuration checks: what a serving setup's wiring and the draft's config say, judged
before anything is measured (the SGLang and vLLM wiring rules, the draft's norm flags). Used by
``hs-tracer check``, by each engine adapter at startup and by the live verdict."""
