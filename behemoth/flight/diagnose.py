"""Who a failed or timed-out operation waited for, from the peers' published snapshots alone (a pure function).

A peer whose counter on the operation's key is below the operation's number has not arrived. Its heartbeat's age
says why: stale, it is stopped, hung or dead (and if its counter has reached the number, it stopped inside the
operation); fresh, it is alive and waits elsewhere, so the chain is followed into the operation it waits in (three
links at most). After a fast failure (not a timeout) a fresh heartbeat cannot tell a dead peer from a live one,
so a peer that had not arrived is named as one that failed or died.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from behemoth.flight.ring import OpRecord, Snapshot

MAX_CHAIN = 3  # links of "waits in ... where ..." followed


@dataclass
class _Walk:
    published: Mapping[int, Snapshot | None]
    me: int
    now: float
    stale_s: float
    seen: set[int] = field(default_factory=set)


def diagnose(rec: OpRecord, published: Mapping[int, Snapshot | None], *, me: int, now: float, stale_s: float, timed_out: bool = True) -> list[str]:
    """One clause per rank that `rec` (issued by rank `me`) waits for and that has not completed it, following busy
    ranks' own waits. `published[r]`: rank r's last snapshot, None if it never published one (asked for every rank
    `rec` or a chain awaits); `stale_s`: the age after which a heartbeat counts as stopped. Empty: every rank arrived."""
    return _blame(rec.key, rec.seq, rec.awaited, _Walk(published, me, now, stale_s), depth=0, timed_out=timed_out)


def _blame(key: str, seq: int, ranks: list[int], walk: _Walk, depth: int, timed_out: bool) -> list[str]:
    out = []
    for r in ranks:
        if r == walk.me or (r in walk.seen and depth > 0):
            continue
        walk.seen.add(r)
        snap = walk.published[r]
        if snap is None:
            out.append(f"rank {r} never published a heartbeat (it may not have started)")
            continue
        done = snap["counters"].get(key, 0)
        age = walk.now - snap["t"]
        if age > walk.stale_s:
            arrived = "never arrived" if done < seq else "arrived but stopped inside it"
            out.append(f"rank {r} {arrived} (its last op there: #{done}; no heartbeat for {age:.0f} s: stopped, hung or dead)")
        elif done < seq and not timed_out:
            out.append(f"rank {r} had not arrived (its last op there: #{done}; it failed or died, see its line)")
        elif done < seq:
            out.append(_busy(r, snap, key, walk, depth))
    return out


def _busy(r: int, snap: Snapshot, key: str, walk: _Walk, depth: int) -> str:
    """A live rank that has not reached the operation: what it waits in, and for whom."""
    waiting = [op for op in snap["ring"] if op["end"] is None]
    if not waiting or depth >= MAX_CHAIN:
        return f"rank {r} never arrived (its last op there: #{snap['counters'].get(key, 0)}; it is alive and elsewhere)"
    op = OpRecord(**min(waiting, key=lambda o: o["start"]))
    inner = _blame(op.key, op.seq, op.awaited, walk, depth + 1, timed_out=True)
    return f"rank {r} never arrived: it waits in {op.describe()}" + (f", where {'; '.join(inner)}" if inner else "")


def hang_line(
    rec: OpRecord,
    culprits: list[str],
    *,
    waited: float,
    limit_s: float,
    timed_out: bool,
    err: BaseException | None,
    limit_name: str = "run.timeout_s",
) -> str:
    """The diagnosis in one line: the operation, how long it waited against the setting `limit_name` (or how it failed),
    and who never arrived."""
    how = f"waited {waited:.1f} s ({limit_name}={limit_s:g})" if timed_out else f"failed after {waited:.1f} s ({c10d_reason(err)})"
    who = "; ".join(culprits) if culprits else "every rank of the group had arrived; the transfer itself stalled"
    return f"{rec.describe()} {how}: {who}"


def c10d_reason(err: BaseException | None) -> str:
    """The first line of c10d's error, without gloo's source location."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0] if err is not None else "no answer"
    return re.sub(r"^\[[^\]]*\.(cc|cpp|hpp|h):\d+\]\s*", "", text)[:140]
