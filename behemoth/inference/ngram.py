"""Prompt-lookup (n-gram) proposals for speculative decoding: no draft model, the request's own tokens predict it.

The last n tokens of a request (prompt and generated so far) are looked up among its earlier tokens; the tokens that
followed their most recent earlier occurrence are proposed (Saxena's prompt lookup decoding; vLLM's `ngram`
speculator). Sizes are tried from `max_n` down to `min_n`; no match proposes nothing and the row decodes one token.
A continuation that reaches the end of the tokens goes on copying its own proposals, so a cycle is proposed whole.
Each request keeps an index of its n-grams (n-gram -> where it last ended), extended by the tokens it gained since
the last lookup, so a step costs O(new tokens), not O(context). A proposal is a point mass: the rejection rule keeps
a token with probability p(d) and redraws from p without d at a refusal (speculative.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from behemoth.errors import BehemothError

if TYPE_CHECKING:
    from behemoth.inference.scheduler import Request


@dataclass(frozen=True)
class NgramDraft:
    """`--speculative ngram`: propose up to `tokens` per step from the longest of the last `min_n`..`max_n` tokens seen before."""

    tokens: int = 4
    max_n: int = 3
    min_n: int = 1

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise BehemothError(
                f"--draft-tokens {self.tokens}: n-gram lookup proposes at least one token per step", "use --draft-tokens 1 or more (e.g. 4)"
            )
        if not 1 <= self.min_n <= self.max_n:
            raise BehemothError(f"n-gram sizes {self.min_n}..{self.max_n}: need 1 <= min <= max", "use e.g. --ngram-min 1 --ngram-max 3")


@dataclass
class NgramIndex:
    """One request's n-grams: each (as a tuple) -> the position of its last token, for ends before `upto`."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    upto: int = 0  # n-grams ending before this position are indexed


def lookup(tokens: list[int], index: NgramIndex, spec: NgramDraft, k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest matching suffix of `tokens`."""
    last = len(tokens) - 1  # an n-gram ending here is the suffix itself: it has no continuation to propose
    for end in range(index.upto, last):
        for n in range(spec.min_n, min(spec.max_n, end + 1) + 1):
            index.ends[tuple(tokens[end - n + 1 : end + 1])] = end
    index.upto = max(index.upto, last)
    for n in range(min(spec.max_n, len(tokens)), spec.min_n - 1, -1):
        found = index.ends.get(tuple(tokens[-n:]))
        if found is not None:
            return overlapping_copy(tokens, found + 1, k)
    return []


def overlapping_copy(tokens: list[int], start: int, k: int) -> list[int]:
    """`k` tokens copied from `start` on, reading the copy's own tokens past the end (LZ77's overlapping copy): a match
    just before the end of a cycle proposes the cycle again, not only what is left of it."""
    out: list[int] = []
    for i in range(k):
        j = start + i
        out.append(tokens[j] if j < len(tokens) else out[j - len(tokens)])
    return out


class NgramProposer:
    """Proposals of every decoding row from its own tokens (speculative.py's Proposer)."""

    def __init__(self, spec: NgramDraft) -> None:
        self.spec = spec
        self.indexes: dict[int, NgramIndex] = {}

    def reserve(self, req: Request, k: int) -> bool:
        return True  # no cache of its own

    def propose(self, rows: list[Request], ks: list[int]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        drafts = [lookup(r.tokens, self.indexes.setdefault(r.id, NgramIndex()), self.spec, k) if k > 0 else [] for r, k in zip(rows, ks)]
        return drafts, [[] for _ in rows]

    def kept(self, req: Request, kept: int) -> None:
        pass

    def release(self, request_id: int) -> None:
        self.indexes.pop(request_id, None)
