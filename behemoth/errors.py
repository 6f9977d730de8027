"""The one error type a user sees: a single line naming the value, the constraint and a fix."""

from collections.abc import Callable
from typing import Any

ERROR_PREFIX = "behemoth: error: "  # how every command prints a BehemothError


class BehemothError(Exception):
    """A problem with the user's request; printed as one line, never as a traceback."""

    def __init__(self, what: str, fix: str | None = None) -> None:
        message = what if fix is None else f"{what}; {fix}"
        super().__init__(message)


def exit_code(command: Callable[..., int], *args: Any) -> int:
    """Run a command; a refused request (BehemothError) is printed as its one line and exits with 2."""
    import sys

    try:
        return command(*args)
    except BehemothError as err:
        print(f"{ERROR_PREFIX}{err}", file=sys.stderr)
        return 2
