"""The errors attngen raises on purpose.

A user error is always one of these, so the CLI can print it as one line and exit with a status
that says whose fault it was; anything else escaping is a bug in attngen.
"""

from __future__ import annotations


class AttnGenError(Exception):
    """Base class of every error attngen raises deliberately."""


class SpecError(AttnGenError):
    """A spec that does not parse or does not make sense, located in its source text.

    `str()` gives the compiler-style one-liner `FILE:LINE:COL: error: MESSAGE`.
    """

    def __init__(self, message: str, filename: str = "<spec>", line: int = 1, column: int = 1):
        self.message = message
        self.filename = filename
        self.line = line
        self.column = column
        super().__init__(self.format())

    def format(self) -> str:
        return f"{self.filename}:{self.line}:{self.column}: error: {self.message}"


class UnsupportedError(SpecError):
    """A spec that is valid but asks for something attngen does not generate yet."""


class KernelInputError(AttnGenError, ValueError):
    """A tensor handed to a kernel that does not fit its spec (raised before any launch)."""


class InternalError(AttnGenError):
    """A pass or the verifier found the IR in a state that should be impossible: a bug in attngen."""
