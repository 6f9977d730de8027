"""A flight recorder of this process's collectives and transfers, and a watchdog that names what a hung wait waits for.

Every collective and point-to-point transfer behemoth issues goes through `behemoth.comm`, which records it in the
ring (`ring.py`): op, group, peer, a sequence number per group (per sender -> receiver path for transfers), start
and end time, the last `RING` operations. Once armed (a job of several ranks), a thread on every rank publishes its
ring and counters to the job's store as a heartbeat (`heartbeat.py`). When a wait fails (c10d's timeout is
run.timeout_s, or a peer died), `diagnose` (a pure function of the published snapshots, `diagnose.py`) compares the
peers' counters with this rank's and says, in one line, which rank(s) never arrived: the ones whose heartbeat
stopped (a stopped, hung or dead process) or, following the chain, the rank a busy peer is itself waiting for.
Every ring it has is written to the run directory's `hang/` folder.

The recorder (`recorder.py`) is per process, like a logger: it holds no process group, only what this process did.
If a wait does not return at all (no c10d timeout fires), the watchdog run on each heartbeat fails the process
itself at run.timeout_s + 5 s. On NCCL, its own flight recorder is switched on too (`nccl_flight_env`).
"""

from behemoth.flight.diagnose import c10d_reason, diagnose, hang_line
from behemoth.flight.heartbeat import Heartbeat, heartbeat_store
from behemoth.flight.recorder import GRACE_S, RECORDER, FlightRecorder, HangError, nccl_flight_env
from behemoth.flight.ring import RING, OpRecord, Ring, Snapshot, group_info

__all__ = [
    "GRACE_S",
    "RECORDER",
    "RING",
    "FlightRecorder",
    "HangError",
    "Heartbeat",
    "OpRecord",
    "Ring",
    "Snapshot",
    "c10d_reason",
    "diagnose",
    "group_info",
    "hang_line",
    "heartbeat_store",
    "nccl_flight_env",
]
