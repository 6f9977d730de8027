"""What a user sees when a request cannot be met: one line per problem, naming the value, the constraint and a fix.

Checks return `Problem`s (so a caller such as the planner can ask "why not" of thousands of plans); only the
edge of the program raises, with `Refused` carrying every problem at once, or `BehemothError` for one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

ERROR_PREFIX = "behemoth: error: "  # how every command prints a BehemothError


class BehemothError(Exception):
    """A problem with the user's request; printed as one line, never as a traceback."""

    def __init__(self, what: str, fix: str | None = None) -> None:
        message = what if fix is None else f"{what}; {fix}"
        super().__init__(message)

    @property
    def lines(self) -> list[str]:
        return [str(self)]


@dataclass(frozen=True)
class Problem:
    """One reason a request cannot run: the option it concerns and a one-line message (value, constraint, fix)."""

    option: str
    message: str

    @classmethod
    def of(cls, option: str, what: str, fix: str | None = None) -> Problem:
        return cls(option, what if fix is None else f"{what}; {fix}")

    @classmethod
    def from_error(cls, option: str, err: BehemothError) -> Problem:
        return cls(option, str(err))

    def __str__(self) -> str:
        return self.message


class Refused(BehemothError):
    """A request refused for one or more problems, all reported."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(p.message for p in self.problems))

    @property
    def lines(self) -> list[str]:
        return [p.message for p in self.problems]


def collect(option: str, check: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Problem]:
    """Run a check that raises BehemothError for its one problem; the problem as a list (empty if it passed)."""
    try:
        check(*args, **kwargs)
    except BehemothError as err:
        return [Problem.from_error(option, err)]
    return []


def exit_code(command: Callable[..., int], *args: Any) -> int:
    """Run a command; a refused request is printed, one line per problem, and exits with 2."""
    import sys

    try:
        return command(*args)
    except BehemothError as err:
        for line in err.lines:
            print(f"{ERROR_PREFIX}{line}", file=sys.stderr)
        return 2
