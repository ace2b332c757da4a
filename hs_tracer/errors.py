"""The one exception type for bad input, and its one-line message.

Every check of what the user gave (files, flags, environment variables) raises :class:`InputError`
or a subclass of it; the CLI prints it as one line and exits 2, the plugin logs it and stays off.
Any other exception is a defect of hs_tracer: the CLI reports it as an internal error (exit 1).
"""

from __future__ import annotations


class InputError(ValueError):
    """A problem with what the user gave us: ``what`` (file, flag or variable), ``problem``, ``fix``.

    Printed as one line (CLI: exit status 2; plugin: one log line, tracing off). A ``ValueError``, so
    code that validates a value and lets the caller decide keeps catching it as one.
    """

    def __init__(self, what: object, problem: str = "", fix: str = "") -> None:
        self.what, self.problem, self.fix = str(what), problem, fix
        # Without ``problem``, ``what`` is a message already written in full.
        text = f"{self.what}: {problem}" + (f"; {fix}" if fix else "") if problem else self.what
        super().__init__(" ".join(text.split()))  # one line, whatever the parts held
