"""The one exception type for bad input, and its one-line message."""

from __future__ import annotations


class InputError(Exception):
    """A problem with what the user gave us: ``what`` (file, flag or variable), ``problem``, ``fix``.

    Printed as one line (CLI: exit status 2; plugin: one log line, tracing off).
    """

    def __init__(self, what: object, problem: str = "", fix: str = "") -> None:
        self.what, self.problem, self.fix = str(what), problem, fix
        # Without ``problem``, ``what`` is a message already written in full.
        text = f"{self.what}: {problem}" + (f"; {fix}" if fix else "") if problem else self.what
        super().__init__(" ".join(text.split()))  # one line, whatever the parts held
