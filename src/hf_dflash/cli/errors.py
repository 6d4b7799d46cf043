"""`UsageError`: a mistake in what the user asked for, which `hf_dflash.cli.main` prints as one line and exit status 2.

Checks raise it; `usage_errors` turns the library's own exceptions of a bad input (a `ValueError` naming a file and
line, an `OSError` from loading) into it around the calls whose failures are the user's to fix. Everything else is a
failure of the program and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

# What `hf_dflash.loading` raises for what the user named: an unknown device or dtype, a drafter that does not fit
# (ValueError), a model that cannot be found or a truncated weights file (OSError), a packaged target whose package
# is not installed (ModuleNotFoundError).
LOAD_ERRORS = (ValueError, OSError, ModuleNotFoundError)


class UsageError(Exception):
    """What the user asked for cannot be done: `main` prints `hf-dflash <command>: error: <message>` on one line and
    exits with status 2 (`hf-dflash --debug <command> ...` shows the traceback instead). The message says what is
    wrong, then what to do."""

    def __init__(self, message: str, prog: str | None = None):
        super().__init__(message)
        self.prog = prog  # `hf-dflash demo` where the parser knows it; `main` fills in the command otherwise


@contextmanager
def usage_errors(*types: type[BaseException]) -> Iterator[None]:
    """Raise the exceptions of `types` raised inside as `UsageError`s with their message (chained, for `--debug`)."""
    try:
        yield
    except types as error:
        raise UsageError(str(error)) from error


__all__ = ["LOAD_ERRORS", "UsageError", "usage_errors"]
