"""A third serving engine as one package: the adapter a new engine needs (its release table, hooks,
state, wiring rule, preflight and the engine object the registry names), over :mod:`.serving`, a
stand-in for the engine's own code that computes nothing but hands its hooks real tensors.
tests/test_fake_engine.py runs it through the whole path."""

NAME = "fake"  # the registry name: the ``hs_tracer.engines`` entry point the test installs
RELEASE = "1.0.0"
