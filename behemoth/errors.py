"""The one error type a user sees: a single line naming the value, the constraint and a fix."""

ERROR_PREFIX = "behemoth: error: "  # how every command prints a BehemothError


class BehemothError(Exception):
    """A problem with the user's request; printed as one line, never as a traceback."""

    def __init__(self, what: str, fix: str | None = None) -> None:
        message = what if fix is None else f"{what}; {fix}"
        super().__init__(message)
