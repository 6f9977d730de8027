"""What fault tolerance costs and saves: the training stall per checkpoint (behemoth synchronous vs in the background,
beside torch DCP's own `save` and `async_save`), and the time from a killed worker to training again (behemoth's
self-healing restart vs stopping and resuming by hand). Run:

    OMP_NUM_THREADS=1 python benchmarks/bench_faults.py            # gpt-20m and gpt2-124m; kills on 2 and 4 processes
    OMP_NUM_THREADS=1 python benchmarks/bench_faults.py --quick    # gpt-20m, one kill on 2 processes: a minute or two

Checkpoints go to a temporary folder (it says how much disk it needs, checks it, and removes what it wrote). Prints
markdown tables.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ratios import ratio, write_rows

ROWS: list = []  # comparisons for `behemoth bench` (--json)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = {
    "gpt-20m": ["model=gpt-20m", "train.global_batch=4", "train.seq_len=128"],
    "gpt2-124m": ["model=gpt2-124m", "train.global_batch=2", "train.seq_len=128"],
}


def stall_rank(cfg_dict: dict[str, Any], folder: str, saves: int) -> dict[str, list[float]]:
    """One rank: train a step, then for each mode save `saves` times with a training step after each save (what a
    background save overlaps); the seconds each save held the training loop, and its full write time."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from behemoth.config import Config
    from behemoth.data import BatchSampler, prepare_corpus
    from behemoth.engine import build_engine
    from behemoth.faults.checkpoint import CheckpointSaver
    from behemoth.topology import init_runtime

    cfg = Config.model_validate(cfg_dict)
    rt = init_runtime(timeout_s=600)
    engine = build_engine(cfg, rt)
    corpus = prepare_corpus(cfg.data.path, cfg.data.val_fraction, cfg.data.cache_dir)
    sampler = BatchSampler(corpus.train, cfg.seq_len, cfg.batch_layout(rt.dims), rt.coordinate("dp"), cfg.train.seed)
    step = lambda i: engine.train_step(sampler.micro_batches(i), cfg.train.lr)  # noqa: E731
    step(0)
    gloo = dist.new_group(backend="gloo")
    out: dict[str, list[float]] = {}
    for mode in ("behemoth sync", "behemoth background", "dcp.save", "dcp.async_save"):
        stalls, pending, saver = [], None, None
        if mode.startswith("behemoth"):
            saver = CheckpointSaver(Path(folder) / mode.replace(" ", "_"), keep=1, group=rt.world_group, background=mode.endswith("background"))
        for i in range(saves):
            dist.barrier()
            t0 = time.perf_counter()
            if saver is not None:
                saver.save(engine.state_dict(), i + 1, {"config": cfg_dict})
            elif mode == "dcp.save":
                dcp.save(engine.state_dict(), checkpoint_id=f"{folder}/dcp_{i}", process_group=rt.world_group)
            else:
                if pending is not None:
                    pending.result()
                pending = dcp.async_save(engine.state_dict(), checkpoint_id=f"{folder}/dcpa_{i}", process_group=gloo)
            stalls.append(time.perf_counter() - t0)
            step(i + 1)
            if rt.is_main and i > 0:  # DCP keeps every checkpoint: remove the previous one as behemoth's keep=1 does
                shutil.rmtree(f"{folder}/{'dcp' if mode == 'dcp.save' else 'dcpa'}_{i - 1}", ignore_errors=True)
        if saver is not None:
            saver.wait()
            out[f"{mode} write"] = saver.write_s
        if pending is not None:
            pending.result()
        out[mode] = stalls
        dist.barrier()
    rt.close()
    return out


def checkpoint_gib(model: str) -> float:
    from behemoth.config import load_config

    return 12 * load_config(None, MODELS[model]).model.num_params() / 2**30


def stall_table(models: list[str], saves: int, nproc: int) -> None:
    from behemoth.config import load_config
    from behemoth.faults.ranks import run_ranks

    print("\n### Checkpoint stall per save (seconds the training loop waits; median of", saves, "saves)\n")
    print("| model | processes | checkpoint GiB | behemoth sync | behemoth background | ratio | full background write | dcp.save | dcp.async_save |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in models:
        need = 6 * checkpoint_gib(model)  # behemoth's two modes keep 1 (+1 being written); DCP's copies are removed as it goes
        with tempfile.TemporaryDirectory(prefix="behemoth-bench-faults-") as folder:
            free = shutil.disk_usage(folder).free / 2**30
            if free < need:
                print(f"| {model} | skipped: needs ~{need:.1f} GiB free in {folder}, has {free:.1f} |")
                continue
            cfg = load_config(None, [*MODELS[model], "run.progress=false"]).model_dump(mode="json")
            r = run_ranks(nproc, stall_rank, cfg, folder, saves, timeout=3600)[0]
        med = {k: statistics.median(v) for k, v in r.items()}
        ROWS.extend(
            [
                ratio(
                    "fault tolerance",
                    f"{model}, {nproc} processes",
                    "dcp.save",
                    "checkpoint stall (synchronous)",
                    med["behemoth sync"],
                    med["dcp.save"],
                    higher_is_better=False,
                ),
                ratio(
                    "fault tolerance",
                    f"{model}, {nproc} processes",
                    "dcp.async_save",
                    "checkpoint stall (background)",
                    med["behemoth background"],
                    med["dcp.async_save"],
                    higher_is_better=False,
                ),
            ]
        )
        print(
            f"| {model} | {nproc} | {checkpoint_gib(model):.2f} | {med['behemoth sync']:.3f} | {med['behemoth background']:.3f} | "
            f"{med['behemoth background'] / med['behemoth sync']:.3f} | {med['behemoth background write']:.3f} | "
            f"{med['dcp.save']:.3f} | {med['dcp.async_save']:.3f} |",
            flush=True,
        )


def rows(run_dir: Path) -> list[str]:
    try:
        return (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []


def launch(run_dir: Path, nproc: int, model: list[str], *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "behemoth",
        "train",
        "--nproc",
        str(nproc),
        *extra,
        f"run.dir={run_dir}",
        "train.steps=100000",
        "checkpoint.every=5",
        "run.progress=false",
        "train.peak_tflops=1",
        "train.eval_every=0",
        *model,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True, cwd=ROOT)


def wait_rows(run_dir: Path, at_least: int, proc: subprocess.Popen | None = None, timeout: float = 600) -> float:
    deadline = time.monotonic() + timeout
    while len([r for r in rows(run_dir) if '"loss"' in r]) < at_least:
        if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
            raise RuntimeError(f"no step {at_least} in {run_dir}: {proc.stderr.read()[-2000:] if proc and proc.stderr else ''}")
        time.sleep(0.02)
    return time.monotonic()


def kill_a_worker(proc: subprocess.Popen) -> float:
    kids = [int(c) for t in Path(f"/proc/{proc.pid}/task").iterdir() for c in (t / "children").read_text().split()]
    workers = sorted(
        c
        for c in kids
        if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes() and b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()
    )
    os.kill(workers[-1], signal.SIGKILL)
    return time.monotonic()


def recovery_times(folder: Path, nproc: int, model: list[str]) -> tuple[float, float]:
    """Seconds from a SIGKILL to the next training step logged: with --max-restarts 1, and stopping + `--resume` by hand."""
    auto = folder / f"auto{nproc}"
    proc = launch(auto, nproc, model, "--max-restarts", "1")
    try:
        wait_rows(auto, 12, proc)
        killed = kill_a_worker(proc)
        # after the restart the log is cut back to the checkpoint: wait for a step row beyond what it keeps
        wait_rows_after_resume(auto, killed)
        automatic = time.monotonic() - killed
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    manual_dir = folder / f"manual{nproc}"
    proc = launch(manual_dir, nproc, model)
    wait_rows(manual_dir, 12, proc)
    killed = kill_a_worker(proc)
    proc.wait()
    again = launch(manual_dir, nproc, [], "--resume", str(manual_dir))
    try:
        wait_rows_after_resume(manual_dir, killed)
        manual = time.monotonic() - killed
    finally:
        os.killpg(again.pid, signal.SIGKILL)
        again.wait()
    return automatic, manual


def wait_rows_after_resume(run_dir: Path, since: float, timeout: float = 600) -> None:
    """Until a training row follows a resume event in the log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = rows(run_dir)
        resumes = [i for i, line in enumerate(lines) if '"event": "resume"' in line]
        if resumes and any('"loss"' in line for line in lines[resumes[-1] :]):
            return
        time.sleep(0.02)
    raise RuntimeError(f"{run_dir}: no training step after a resume within {timeout:.0f} s")


def recovery_table(nprocs: list[int], trials: int, model_name: str) -> None:
    model = (
        ["model=gpt-1m", "train.global_batch=8", "train.seq_len=64"]
        if model_name == "gpt-1m"
        else ["model=gpt-tiny", "train.global_batch=8", "train.seq_len=32"]
    )
    print(f"\n### From a killed worker to training again ({model_name}; median of {trials})\n")
    print("| processes | behemoth --max-restarts (s) | stop + `--resume` by hand (s) | ratio |")
    print("|---|---|---|---|")
    for nproc in nprocs:
        autos, manuals = [], []
        for _ in range(trials):
            with tempfile.TemporaryDirectory(prefix="behemoth-bench-faults-") as folder:
                a, m = recovery_times(Path(folder), nproc, model)
            autos.append(a)
            manuals.append(m)
        a, m = statistics.median(autos), statistics.median(manuals)
        ROWS.append(
            ratio(
                "fault tolerance",
                f"{model_name}, {nproc} processes",
                "stop + --resume by hand",
                "kill to training again",
                a,
                m,
                higher_is_better=False,
            )
        )
        print(f"| {nproc} | {a:.1f} | {m:.1f} | {a / m:.2f} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt-20m only, 2 saves, one kill on 2 processes (tiny model)")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", help="also write the ratio rows to FILE (for `behemoth bench`)")
    args = parser.parse_args(argv)
    if args.quick:
        stall_table(["gpt-20m"], 2, 2)
        recovery_table([2], 1, "gpt-tiny")
    else:
        stall_table(["gpt-20m", "gpt2-124m"], args.saves, 2)
        recovery_table([2, 4], args.trials, "gpt-1m")
    write_rows(args.json, ROWS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
