"""Input validation: one module per kind of input, run before any work and before any output.

Every command and the SGLang plugin go through these checks, so the same bad input gets the same
message everywhere. A failed check raises :class:`InputError`: one line naming the file or variable,
what is wrong with it and how to fix it. The CLI prints it and exits 2; the plugin logs it and stays
off. :mod:`.outputs` is the other half: results are written atomically, next to their destination,
and never over an input.
"""

from hs_tracer.errors import InputError

__all__ = ["InputError"]
