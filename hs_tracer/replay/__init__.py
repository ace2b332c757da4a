"""``hs-tracer replay``: the standalone drafter test on captured live features (plain torch, no SGLang).

:mod:`.data` reads captures and training dumps into sequences, :mod:`.runner` runs the draft under a
wiring and scores next-token agreement, :mod:`.analysis` compares live with training level, tries the
rewirings the capture allows and states the fix.
"""
