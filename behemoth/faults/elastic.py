"""Local workers under torch's elastic agent: restarts, a short stop, stores on the loopback only, nothing left in /tmp.

`launch_local` runs one agent with N workers (`behemoth train --nproc N`); `launch_nodes` runs MAX single-worker
agents that rendezvous as elastic nodes with a minimum of MIN (`--nproc MIN:MAX`), so that losing one (its agent
killed, its device gone) leaves the others to continue on fewer processes, exactly as torchrun's `--nnodes MIN:MAX`
does across machines. With `max_restarts`, a failed worker group is stopped and started again; the workers resume
from the run's newest intact checkpoint themselves (`behemoth.faults.recovery`).

What differs from `torch.distributed.run` on one machine, and why:
- both rendezvous stores (the agents' and the workers') listen on 127.0.0.1 only (torch binds every interface),
  and gloo / NCCL are pointed at the loopback interface;
- workers the agent stops get `grace_s` (not 30 s) to exit, and a stopped (SIGSTOP) worker is woken so it can;
- the agent's log folders and error files go to a private temporary folder that is removed afterwards;
- each restart is announced in one line naming the failed rank.

A decision that every worker of a (re)started group must share — the plan of a new world size (`elastic.replan`,
planner/replan.py) — is made once, on the group's first rank, and broadcast (`decided_once`): ranks that each decided
for themselves could disagree (a calibration cache on one host, a probe's timing on another).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

from behemoth.comm import broadcast_object
from behemoth.errors import ERROR_PREFIX, BehemothError
from behemoth.flight.recorder import SELF_PAUSED

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ElasticPolicy:
    """How a local job reacts to failures: restarts allowed, the stop grace, rendezvous and node-loss timing."""

    max_restarts: int = 0
    grace_s: float = 3.0
    join_timeout_s: float = 300.0
    last_call_s: float = 10.0  # once MIN nodes are in, how long to wait for more
    keep_alive_s: float = 1.0  # a node whose agent misses 3 heartbeats is gone


def decided_once(make: Callable[[], Any], group: dist.ProcessGroup, is_source: bool) -> Any:
    """`make()` run on the group's first rank only and its result returned on every rank; a BehemothError it raises is
    raised on every rank, with its message, so that no rank waits for a decision that failed."""

    def attempt() -> tuple[str, Any]:
        try:
            return "ok", make()
        except BehemothError as err:
            return "error", str(err)

    status, value = broadcast_object(attempt, group, is_source)
    if status == "error":
        raise BehemothError(value)
    return value


def describe_failures(failures: dict[int, Any]) -> str:
    """One line for failed workers: the root cause first (a worker killed by a signal, then one that failed on its own,
    then one whose collective failed because of another, then one that was itself stopped), and what it said (its behemoth line, its signal, or the
    last line of its error)."""

    def cause(item: tuple[int, Any]) -> tuple[int, int]:
        rank, failure = item
        killed = failure.exitcode is not None and failure.exitcode < 0
        message = message_of(failure)
        hang = 3 if SELF_PAUSED in message else 2 if "HangError" in message else 1  # a rank that was itself stopped last
        return (0 if killed else hang), rank

    rank, failure = min(failures.items(), key=cause)
    message = message_of(failure)
    line = next((l for l in message.splitlines() if l.startswith(ERROR_PREFIX)), None)
    if line is None:
        lines = [l.strip() for l in message.strip().splitlines() if l.strip() and "To enable traceback" not in l]
        if failure.exitcode is not None and failure.exitcode < 0:
            line = f"killed by signal {signal.Signals(-failure.exitcode).name}"
        elif lines and "Error" in lines[-1]:
            line = lines[-1].split("BehemothError: ")[-1].split("HangError: ")[-1]
        else:
            line = f"exited with code {failure.exitcode}"
    return f"worker rank {rank} failed: {line.removeprefix(ERROR_PREFIX)}"


def message_of(failure: Any) -> str:
    """A failure record's message as text."""
    if isinstance(failure.message, dict):
        return str(failure.message.get("message", failure.message))
    return failure.message if isinstance(failure.message, str) else str(failure.message)


def quiet_launcher_logs() -> None:
    """The elastic agent logs every failure at length; behemoth reports it in one line instead."""
    for name in list(logging.root.manager.loggerDict) + ["torch.distributed.elastic"]:
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def loopback_store(port: int = 0, *, timeout_s: float = 300.0) -> dist.TCPStore:
    """A TCPStore server listening on 127.0.0.1 only (torch's own binds every interface): it is handed a socket bound
    to the loopback, whose descriptor it then owns and closes."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(128)
    bound = sock.getsockname()[1]
    return dist.TCPStore(
        LOOPBACK,
        bound,
        is_master=True,
        master_listen_fd=sock.detach(),
        wait_for_workers=False,
        multi_tenant=True,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class LoopbackRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous, whose store for the workers listens on the loopback only and is new in every round
    (torch keeps one for the whole run, where a restarted worker can read a dead one's gloo address and fail to connect)."""

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> dist.TCPStore:
        return loopback_store(master_port)

    def next_rendezvous(self) -> Any:
        self._bootstrap_store_info = None
        self._shared_tcp_store_server = None
        return super().next_rendezvous()


def rendezvous(store: dist.Store, run_id: str, nodes: tuple[int, int], policy: ElasticPolicy) -> LoopbackRendezvousHandler:
    """A handler for this agent over `store` (the c10d rendezvous backend), between nodes[0] and nodes[1] agents."""
    timeout = RendezvousTimeout(
        join=datetime.timedelta(seconds=policy.join_timeout_s),
        last_call=datetime.timedelta(seconds=policy.last_call_s),
        close=datetime.timedelta(seconds=10),
    )
    return LoopbackRendezvousHandler.from_backend(
        run_id,
        store,
        C10dRendezvousBackend(store, run_id),
        nodes[0],
        nodes[1],
        LOOPBACK,
        timeout,
        keep_alive_interval=max(1, int(policy.keep_alive_s)),
        keep_alive_max_attempt=3,
    )


class BehemothAgent(LocalElasticAgent):
    """torch's local agent with a short stop (stopped workers woken first) and a line per restart."""

    def __init__(self, spec: WorkerSpec, *, grace_s: float, log_dir: str) -> None:
        super().__init__(spec, DefaultLogsSpecs(log_dir=log_dir), start_method="spawn", shutdown_timeout=int(max(1, grace_s)))
        self.grace_s = grace_s
        self.last_failure: RunResult | None = None
        self.dead_at_wake: dict[int, int] = {}  # local rank -> pid: workers already gone when a stopped one was woken
        self.wake_lock = threading.Lock()

    def run(self, role: str = "default") -> RunResult:
        """torch's run, with a thread that wakes stopped workers once a peer has died, also while torch's process context
        is inside its join: a peer that dies just after a monitoring pass is found by the join, which then sends the
        stopped worker SIGTERM and waits 30 s for it to act."""
        done = threading.Event()
        waker = threading.Thread(target=self.wake_while_running, args=(done,), name="behemoth-waker", daemon=True)
        waker.start()
        try:
            return super().run(role)
        finally:
            done.set()
            waker.join()

    def wake_while_running(self, done: threading.Event) -> None:
        while not done.wait(0.1):
            self.wake_stopped()

    def wake_stopped(self) -> None:
        context = self._pcontext
        if context is None:
            return
        with contextlib.suppress(Exception):  # the context may close or be replaced (a restart) under the thread
            dead = wake_if_peer_died(context.pids())
            with self.wake_lock:
                self.dead_at_wake.update(dead)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        if self._pcontext is not None:
            for pid in self._pcontext.pids().values():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM until it runs again
        super()._shutdown(death_sig, int(max(1, min(timeout, self.grace_s))))

    def _monitor_workers(self, worker_group: Any) -> RunResult:
        self.wake_stopped()
        result = super()._monitor_workers(worker_group)
        if result.is_failed():
            self.add_failures_of_the_dead(result, worker_group)
            self.last_failure = result
        return result

    def add_failures_of_the_dead(self, result: RunResult, worker_group: Any) -> None:
        """torch's process context reports the first failed worker it finds ready; a stopped worker woken because a
        peer had died can be ready first (it was past its timeout and exits at once), and its line is not the cause.
        Every worker that had already failed when it was woken is added to `result.failures`, so that the one-line
        report can pick the root cause among them."""
        processes = getattr(getattr(self._pcontext, "_pc", None), "processes", None)
        error_files = getattr(self._pcontext, "error_files", {})
        with self.wake_lock:
            dead, self.dead_at_wake = self.dead_at_wake, {}
        for local_rank, pid in dead.items():
            rank = worker_group.workers[local_rank].global_rank
            exitcode = processes[local_rank].exitcode if processes is not None else 1
            if rank in result.failures or exitcode == 0:
                continue
            result.failures[rank] = ProcessFailure(local_rank, pid, 1 if exitcode is None else exitcode, error_files.get(local_rank, ""))

    def _restart_workers(self, worker_group: Any) -> None:
        spec = worker_group.spec
        done = spec.max_restarts - self._remaining_restarts
        if self.last_failure is not None:
            print(
                f"behemoth: {describe_failures(self.last_failure.failures)}; restarting the workers "
                f"(restart {done} of {spec.max_restarts}) to resume from the newest intact checkpoint",
                file=sys.stderr,
                flush=True,
            )
            self.last_failure = None
        super()._restart_workers(worker_group)


def process_state(pid: int) -> str | None:
    """The state letter of a process in /proc (R, S, T stopped, Z exited, ...), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def wake_if_peer_died(pids: dict[int, int]) -> dict[int, int]:
    """Once a worker has exited, wake any stopped (SIGSTOP) one: the launcher then stops the rest with SIGTERM, which a
    stopped process would hold for the 30 s torch waits before SIGKILL. `pids` maps local rank -> pid; the workers that
    had exited when one was woken are returned (local rank -> pid), empty if none was woken."""
    states = {rank: (pid, process_state(pid)) for rank, pid in pids.items()}
    dead = {rank: pid for rank, (pid, state) in states.items() if state in (None, "Z", "X")}
    stopped = [pid for pid, state in states.values() if state == "T"]
    if not dead or not stopped:
        return {}
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGCONT)
    return dead


def run_agent(entrypoint: Callable[..., Any], args: tuple, *, nproc: int, handler: Any, policy: ElasticPolicy, log_dir: str) -> dict[int, Any]:
    """Run `nproc` workers under one agent until they succeed or the restarts are spent; {global rank: return value}."""
    spec = WorkerSpec(
        role="behemoth",
        local_world_size=nproc,
        entrypoint=entrypoint,
        args=args,
        rdzv_handler=handler,
        max_restarts=policy.max_restarts,
        monitor_interval=0.2,
        local_addr=LOOPBACK,
    )
    agent = BehemothAgent(spec, grace_s=policy.grace_s, log_dir=log_dir)
    try:
        result = agent.run()
    finally:
        handler.shutdown()
    if result is None:
        raise BehemothError("the run was closed before its workers finished", "start it again with --resume")
    if result.is_failed():
        raise BehemothError(describe_failures(result.failures))
    return result.return_values


@contextlib.contextmanager
def local_launch_env(nproc: int) -> Iterator[str]:
    """For the duration of a local launch: a private temporary folder (the agent's logs and error files, the workers'
    TMPDIR) removed afterwards, and gloo / NCCL bound to the loopback interface. torch's own default inductor cache
    folder, which importing torch._dynamo wrote into TORCHINDUCTOR_CACHE_DIR, is not passed on as if the user chose it
    (the workers' different TMPDIR would hide where it came from): they cache under BEHEMOTH_CACHE."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    folder = tempfile.mkdtemp(prefix="behemoth-launch-")
    saved_env, saved_tempdir = dict(os.environ), tempfile.tempdir
    if os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")) == os.path.abspath(default_cache_dir()):
        del os.environ["TORCHINDUCTOR_CACHE_DIR"]
    loopback = loopback_interface()
    os.environ.update(TMPDIR=folder, BEHEMOTH_LAUNCHER="1", **({"GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": loopback} if loopback else {}))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")  # restarted workers reconnect (torch 2.13's gloo needs it)
    tempfile.tempdir = folder
    try:
        yield folder
    finally:
        tempfile.tempdir = saved_tempdir
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(folder, ignore_errors=True)


def loopback_interface() -> str | None:
    """The name of the loopback network interface (`lo` on Linux), if there is one."""
    with contextlib.suppress(OSError):
        names = [name for _, name in socket.if_nameindex()]
        return "lo" if "lo" in names else next((n for n in names if n.startswith("lo")), None)
    return None


def launch_local(nproc: int, entrypoint: Callable[..., Any], args: tuple, policy: ElasticPolicy) -> dict[int, Any]:
    """`nproc` workers on this machine under one agent; {global rank: return value}."""
    quiet_launcher_logs()
    with local_launch_env(nproc) as folder:
        store = loopback_store(timeout_s=policy.join_timeout_s)
        handler = rendezvous(store, uuid.uuid4().hex, (1, 1), policy)
        return run_agent(entrypoint, args, nproc=nproc, handler=handler, policy=policy, log_dir=os.path.join(folder, "agent"))


def launch_nodes(nodes: tuple[int, int], entrypoint: Callable[..., Any], args: tuple, policy: ElasticPolicy) -> dict[int, Any]:
    """nodes[1] single-worker agents on this machine, elastic down to nodes[0]: each is a node that can be lost
    while the rest continue. Returns rank 0's {0: return value} from the last round."""
    quiet_launcher_logs()
    with local_launch_env(nodes[1]) as folder:
        store = loopback_store(timeout_s=policy.join_timeout_s)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        run_id = uuid.uuid4().hex
        agents = [
            ctx.Process(target=_node_main, args=(i, store.port, run_id, nodes, policy, folder, entrypoint, args, results), daemon=False)
            for i in range(nodes[1])
        ]
        for p in agents:
            p.start()
        outcomes = []
        while any(p.is_alive() for p in agents) or not results.empty():
            with contextlib.suppress(queue.Empty):
                outcomes.append(results.get(timeout=0.5))
    finished = [o for o in outcomes if o[0] == "ok" and 0 in o[1]]
    if finished:
        return finished[0][1]
    errors = [o[1] for o in outcomes if o[0] == "error"]
    raise BehemothError(errors[0] if errors else "every node of the run was lost before it finished", "start it again with --resume")


def _node_main(
    index: int,
    port: int,
    run_id: str,
    nodes: tuple[int, int],
    policy: ElasticPolicy,
    folder: str,
    entrypoint: Callable[..., Any],
    args: tuple,
    results: Any,
) -> None:
    """One node's agent process: join the loopback rendezvous as a client, run one worker, report back."""
    quiet_launcher_logs()
    store = dist.TCPStore(LOOPBACK, port, is_master=False, timeout=datetime.timedelta(seconds=policy.join_timeout_s))
    handler = rendezvous(store, run_id, nodes, policy)
    try:
        results.put(("ok", run_agent(entrypoint, args, nproc=1, handler=handler, policy=policy, log_dir=os.path.join(folder, f"node{index}"))))
    except BehemothError as err:
        results.put(("error", str(err)))
    except Exception as err:  # the rendezvous closed or failed: this node is out of the run
        results.put(("error", f"node {index}: {err.__class__.__name__}: {str(err).splitlines()[0] if str(err) else ''}"))
