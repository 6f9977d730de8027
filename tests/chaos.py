"""Chaos: SIGKILL a random rank of `behemoth train --max-restarts 3` at a random step, many times. Every run must finish by
itself, and its final loss must equal the uninterrupted run's, bit for bit (same process count).

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.chaos --trials 20            # about 12 minutes on 2 cores
    OMP_NUM_THREADS=1 .venv/bin/python -m tests.chaos --trials 3 --nproc 4

Also the helpers the fault tests share: starting a run, finding its workers, its listening sockets, its metrics.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.common import CACHE

TINY = [
    "model=gpt-tiny",
    "train.global_batch=8",
    "train.seq_len=32",
    "train.eval_every=8",
    "train.eval_batches=1",
    "train.warmup_steps=2",
    "train.peak_tflops=1",
    "run.progress=false",
    f"data.cache_dir={CACHE}",
]


@contextlib.contextmanager
def reaped(*procs: subprocess.Popen) -> Iterator[None]:
    """Whatever happens in the block, no launched job (each in a session of its own) outlives it."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def start(run_dir: Path, *args: str, nproc: str = "2", restarts: int = 3, steps: int = 24, timeout_s: float = 30) -> subprocess.Popen:
    """`behemoth train` in the background: a tiny model checkpointing every 4 steps."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "behemoth",
        "train",
        "--nproc",
        nproc,
        "--max-restarts",
        str(restarts),
        f"train.steps={steps}",
        "checkpoint.every=4",
        f"run.timeout_s={timeout_s}",
        f"run.dir={run_dir}",
        *TINY,
        *args,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every process below `pid`."""
    out = []
    try:
        children = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except OSError:
        return out
    for child in children:
        out += [child, *descendants(child)]
    return out


def workers(pid: int) -> list[int]:
    """The training workers (spawned processes running the worker entry point) below `pid`, oldest first."""
    found = []
    for child in descendants(pid):
        try:
            if (
                b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()
                and b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes()
            ):
                found.append(child)
        except OSError:
            continue
    return sorted(found)


def training_rows(run_dir: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    except (OSError, ValueError):
        return []


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, *, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not training_rows(run_dir) or training_rows(run_dir)[-1]["step"] < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the run never reached step {step}: {proc.poll()=}")
        time.sleep(0.05)


def listening_addresses(pids: list[int]) -> list[str]:
    """host:port of every listening TCP socket the processes hold (from /proc/net/tcp{,6} and their file descriptors)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                out.append(decode_address(fields[1]))
    return out


def decode_address(field: str) -> str:
    """/proc/net/tcp's little-endian hex address as text (IPv4, or IPv6 as eight groups)."""
    host, port = field.split(":")
    words = [bytes.fromhex(host[i : i + 8])[::-1] for i in range(0, len(host), 8)]
    raw = b"".join(words)
    if len(raw) == 4:
        return f"{'.'.join(str(b) for b in raw)}:{int(port, 16)}"
    return f"[{':'.join(raw[i : i + 2].hex() for i in range(0, 16, 2))}]:{int(port, 16)}"


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("[0000:0000:0000:0000:0000:0000:0000:0001]",) or host.startswith("[0000:0000:0000:0000:0000:ffff:7f")


@dataclass
class Trial:
    step: int
    victim: int
    returncode: int
    final_loss: float | None
    seconds: float
    restarts: int
    stderr: str


def run_trial(run_dir: Path, kill_step: int, victim_index: int, **kw) -> Trial:
    """Start a run, SIGKILL worker `victim_index` (oldest first) once it has logged step `kill_step`, let it finish."""
    t0 = time.monotonic()
    proc = start(run_dir, **kw)
    with reaped(proc):
        wait_for_step(proc, run_dir, kill_step)
        victims = workers(proc.pid)
        victim = victims[victim_index % len(victims)]
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=400)
    rows = training_rows(run_dir)
    final = rows[-1]["loss"] if proc.returncode == 0 and rows else None
    return Trial(kill_step, victim_index, proc.returncode, final, time.monotonic() - t0, err.count("restarting the workers"), err)


def reference_loss(run_dir: Path, **kw) -> float:
    proc = start(run_dir, **kw)
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-2000:]
    return training_rows(run_dir)[-1]["loss"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="behemoth-chaos-") as folder:
        kw = {"nproc": str(args.nproc), "steps": args.steps}
        reference = reference_loss(Path(folder) / "reference", **kw)
        print(f"uninterrupted run: final loss {reference!r}")
        print(f"{'trial':>5} {'kill at step':>12} {'worker':>6} {'restarts':>8} {'seconds':>7}  final loss  same")
        failed = 0
        for i in range(args.trials):
            kill_at = rng.randrange(1, args.steps * 3 // 4)  # the kill lands a little after it is asked for: not at the very end
            t = run_trial(Path(folder) / f"trial{i}", kill_at, rng.randrange(args.nproc), **kw)
            same = t.final_loss == reference
            failed += not same
            print(f"{i:>5} {t.step:>12} {t.victim:>6} {t.restarts:>8} {t.seconds:>7.1f}  {t.final_loss!r:>10}  {'yes' if same else 'NO'}")
            if not same:
                print("\n".join(line for line in t.stderr.splitlines() if line.startswith("behemoth")))
    print(f"{args.trials - failed} of {args.trials} runs finished by themselves with the uninterrupted final loss")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
