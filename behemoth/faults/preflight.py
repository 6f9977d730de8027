"""What a launch needs from the machine, checked before any worker starts: a run directory that can be written and holds
no other run, Hugging Face weights that are complete, and the disk the run's checkpoints will take.

Each check returns `Problem`s; `planner.feasibility.launch_problems` gathers them with every other reason, so the
user gets all of them at once, in one line each.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from behemoth.config import Config
from behemoth.errors import Problem
from behemoth.models.causal_lm import num_params

RUN_FILES = ("config.yaml", "metrics.jsonl", "loss.png", "model.safetensors", "checkpoints")
CHECKPOINT_BYTES_PER_PARAM = 12  # float32 weights and AdamW's two moments
GIB = 2**30


def run_dir_problems(run_dir: str, *, resuming: bool) -> list[Problem]:
    """A run directory that holds another run's files (unless resumed), or cannot be written."""
    path = Path(run_dir).expanduser()
    out = []
    if not resuming and path.is_dir():
        found = [name for name in RUN_FILES if (path / name).exists()]
        if (path / "checkpoints" / "latest").exists():
            out.append(
                Problem.of("run.dir", f"run.dir={run_dir} already holds checkpoints", "pass --resume to continue it, or choose another run.dir")
            )
        elif found:
            out.append(
                Problem.of(
                    "run.dir",
                    f"run.dir={run_dir} holds another run's files ({', '.join(found)})",
                    "choose another run.dir (unset, each run gets a new one), remove them, or pass --resume to continue that run",
                )
            )
    reason = probe_writable(path)
    if reason:
        out.append(Problem.of("run.dir", f"run.dir={run_dir} cannot be written: {reason}", "choose a directory you can write to"))
    return out


def probe_writable(path: Path) -> str | None:
    """Create and remove a probe file in `path` (creating missing folders, and removing them again); why that failed, or None."""
    missing, parent = [], path
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, not a folder"
    created: list[Path] = []
    try:
        for folder in reversed(missing):
            folder.mkdir()
            created.append(folder)
        probe = path / f".behemoth-probe-{os.getpid()}"
        probe.write_bytes(b"probe")
        probe.unlink()
        return None
    except OSError as err:
        return err.strerror or err.__class__.__name__
    finally:
        for folder in reversed(created):
            try:
                folder.rmdir()
            except OSError:
                pass


def disk_problems(cfg: Config, run_dir: str) -> list[Problem]:
    """Too little free disk for the checkpoints the run keeps (checkpoint.keep, one more while a new one is written),
    an offloaded run's scratch, and the exported weights when the run exports them; what is already in the run
    directory counts as space it will reuse."""
    path = Path(run_dir).expanduser()
    params = num_params(cfg.model, cfg.hf)
    linked, copied, scratch = checkpoint_bytes(cfg, params)
    export = 4 * params if exports(cfg) else 0
    anchor = path
    while not anchor.exists():
        anchor = anchor.parent
    free = shutil.disk_usage(anchor if anchor.is_dir() else anchor.parent).free
    if cfg.offload.enabled and cfg.offload.commit == "journal":
        reused = used_bytes(path) + allocated_bytes(cfg.offload.scratch_dir(run_dir))  # a resume writes over its scratch
        return journal_disk_problems(cfg, run_dir, free, export - reused)
    # a new checkpoint links the scratch (metadata only); once the run writes on, each kept one holds its own bytes
    need = cfg.checkpoint.keep * (linked + copied) + copied + scratch + export - used_bytes(path)
    if free >= need:
        return []
    if linked:
        what = (
            f"an offloaded run whose scratch takes {scratch / GIB:.2f} GiB keeps checkpoint.keep={cfg.checkpoint.keep} "
            f"checkpoint(s) that link it ({linked / GIB:.2f} GiB each once the run writes on, copy-on-write"
            + (f", plus {copied / GIB:.2f} GiB written" if copied else "")
            + ")"
        )
    else:
        what = f"the run keeps checkpoint.keep={cfg.checkpoint.keep} checkpoints of ~{copied / GIB:.2f} GiB (one more while a new one is written)"
    exported = f" and {export / GIB:.2f} GiB of exported weights" if export else ""
    return [
        Problem.of(
            "checkpoint.keep",
            f"run.dir={run_dir} has {free / GIB:.2f} GiB free, but {what}{exported}: about {need / GIB:.2f} GiB",
            "free disk space, lower checkpoint.keep, or choose a run.dir on a larger disk"
            + (", or use offload.optimizer_bits=8" if linked and cfg.offload.optimizer_bits == 32 else ""),
        )
    ]


JOURNAL_MARGIN = GIB  # beside a journaled run's files: its logs, markers and file-system slack


def journal_bytes(cfg: Config) -> dict[str, int]:
    """What an offload.commit=journal run holds on disk, by part: the state (float32 weights, Adam's moments), the
    gradient log (one gradient in the compute dtype), the units being written beside their files (one per I/O thread,
    the largest unit's weights and moments), a margin. Checkpoints add nothing: they mark the run, or (the last) link
    the scratch once nothing writes it any more."""
    params, off, m = num_params(cfg.model, cfg.hf), cfg.offload, cfg.model
    per_param = 4 + (8 if off.optimizer_bits == 32 else 2 + 8 / 256)
    embedding = m.vocab_size * m.d_model
    block = (params - embedding * (1 if m.tie_embeddings else 2)) // max(1, m.n_layer)
    return {
        "state": int(per_param * params),
        "gradient log": (2 if cfg.parallel.param_dtype == "bf16" else 4) * params,
        "units in flight": int(off.io_threads * per_param * max(embedding, block)),
        "margin": JOURNAL_MARGIN,
    }


def journal_disk_problems(cfg: Config, run_dir: str, free: int, extra: int) -> list[Problem]:
    """Too little free disk for a journaled offloaded run (`journal_bytes`; `extra`: an export, less what the run reuses)."""
    parts = journal_bytes(cfg)
    need = sum(parts.values()) + extra
    if free >= need:
        return []
    what = " + ".join(f"{n / GIB:.2f} GiB {k}" for k, n in parts.items())
    return [
        Problem.of(
            "offload.commit",
            f"run.dir={run_dir} has {free / GIB:.2f} GiB free, but a journaled offloaded run needs {what}"
            + (f" + {extra / GIB:.2f} GiB of exported weights" if extra > 0 else "")
            + f": about {need / GIB:.2f} GiB",
            "free disk space, choose a run.dir on a larger disk, use offload.optimizer_bits=8, or parallel.param_dtype=bf16 (a bf16 gradient log)",
        )
    ]


def checkpoint_bytes(cfg: Config, params: int) -> tuple[int, int, int]:
    """(bytes a checkpoint links from the disk tier, bytes it writes, bytes of the scratch itself) for `params` parameters:
    float32 weights, and Adam's two float32 moments or 8-bit ones (a byte each plus a float32 scale per 256)."""
    off = cfg.offload
    optimizer = 8 * params if off.optimizer_bits == 32 else 2 * params + 8 * params // 256
    if not off.enabled:
        return 0, CHECKPOINT_BYTES_PER_PARAM * params, 0
    on_disk = {"params": off.params == "disk", "optimizer": off.optimizer == "disk"}
    sizes = {"params": 4 * params, "optimizer": optimizer}
    linked = sum(n for k, n in sizes.items() if on_disk[k])
    grads = 4 * params if off.grads_tier == "disk" and not (off.step == "fused" or (off.step == "auto" and cfg.train.grad_clip == 0)) else 0
    return linked, sum(n for k, n in sizes.items() if not on_disk[k]), linked + grads


def exports(cfg: Config) -> bool:
    """checkpoint.export: true, false, or auto (unless offload streams the states: ZeRO-Offload's weights are whole)."""
    return not cfg.offload_streams if cfg.checkpoint.export == "auto" else bool(cfg.checkpoint.export)


def allocated_bytes(folder: Path) -> int:
    """Disk blocks the files under `folder` hold (0 when it does not exist)."""
    return sum(f.stat().st_blocks * 512 for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


def used_bytes(run_dir: Path) -> int:
    """Bytes of checkpoints and exported weights already in a run directory (a resumed run replaces them)."""
    files = [*(run_dir / "checkpoints").rglob("*"), run_dir / "model.safetensors"] if run_dir.is_dir() else []
    return sum(f.stat().st_size for f in files if f.is_file())


def weights_problems(weights: str) -> list[Problem]:
    """hf.weights without safetensors, with a shard its index names missing, or with a file that is not safetensors.
    (config.json itself, a mapping with the keys the architecture needs, is checked when the config is read.)"""
    from safetensors import safe_open

    folder = Path(weights).expanduser()
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return [
            Problem.of(
                "hf.weights", f"hf.weights={weights} holds no *.safetensors file", "save the model with save_pretrained(..., safe_serialization=True)"
            )
        ]
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            listed = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return [
                Problem.of("hf.weights", f"hf.weights={weights}: {index.name} is not a readable index", "save the model again with save_pretrained")
            ]
        missing = sorted(listed - {f.name for f in files})
        if missing:
            return [
                Problem.of(
                    "hf.weights",
                    f"hf.weights={weights}: {index.name} lists {missing[0]}, which is missing",
                    "copy every shard of the model, or save it again with save_pretrained",
                )
            ]
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                handle.keys()
        except Exception as err:  # safetensors raises its own types for a damaged header
            return [
                Problem.of(
                    "hf.weights",
                    f"hf.weights={weights}: {f.name} is not a readable safetensors file ({err.__class__.__name__})",
                    "copy the file again, or save the model again with save_pretrained",
                )
            ]
    return []


def environment_problems(cfg: Config, *, resuming: bool) -> list[Problem]:
    """Every problem of the machine a launch of `cfg` would meet: run directory, weights, disk."""
    out = []
    if cfg.run.dir:
        out += run_dir_problems(cfg.run.dir, resuming=resuming)
        if not out:
            out += disk_problems(cfg, cfg.run.dir)
    if cfg.hf.weights:
        out += weights_problems(cfg.hf.weights)
    return out
