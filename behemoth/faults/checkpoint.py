"""Checkpoints through torch.distributed.checkpoint (DCP), written atomically, sealed with digests, read safely.

Layout of a run directory's `checkpoints/` folder:

    step_0000100/          a complete checkpoint: DCP files (.metadata, __*_*.distcp), rng/, meta.json
    step_0000100.partial/  a checkpoint being written; never read, removed on the next save
    latest                 text: the name of the newest complete checkpoint (a step_* folder beside it)

All ranks write into `step_N.partial/` and hash the files they wrote; rank 0 adds meta.json (step, config, world
size, every file's size and SHA-256, sealed), renames the folder and then swaps `latest`, so a crash at any moment
leaves the previous checkpoint loadable. Tensors are saved by their names in the single-process model, so a
checkpoint loads under any number of processes. Nothing is read before `behemoth.faults.integrity.verify` has checked
every byte, and DCP's pickled index is read through an allow-list (a checkpoint cannot run code).

`CheckpointSaver` writes in the background when asked (checkpoint.async_save): training waits only while the
state is copied to host memory (the stall, measured), and the write, the digests and the publication run on a
thread over a gloo group of their own, so they never interleave with the training's collectives.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from behemoth.comm import barrier, gather_object
from behemoth.errors import BehemothError
from behemoth.faults.integrity import (
    Backing,
    CheckpointDamage,
    DigestingWriter,
    LinkingWriter,
    SafeFileSystemReader,
    SafeLoadPlanner,
    digest_files,
    file_digest,
    read_dcp_metadata,
    seal,
    verify,
)
from behemoth.models.causal_lm import tied_names

LATEST = "latest"
STEP_NAME = re.compile(r"step_\d{7,}")
SHAPE_FIELDS = ("n_layer", "n_head", "d_model", "context", "vocab_size", "mlp_ratio", "bias", "tie_embeddings", "moe")  # what weights depend on


def shape_value(key: str, value: Any) -> Any:
    """A model field as the weights see it: `bias` unset is the family's default (biases), as an older config's true;
    of model.moe, only the fields that decide which weights exist (routing settings do not)."""
    if key == "moe":
        moe = value or {}
        return None if not moe.get("experts") else (moe["experts"], moe.get("every", 1), moe.get("shared_expert", False))
    return True if key == "bias" and value is None else value


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step_{step:07d}"


def save_checkpoint(
    state: dict[str, Any],
    run_dir: str | Path,
    step: int,
    meta: dict[str, Any],
    *,
    keep: int,
    group: dist.ProcessGroup,
    rng: dict[str, Any] | None = None,
    backing: Backing | None = None,
) -> Path:
    """Write `state` (a DCP state dict) as checkpoint `step`; collective over `group`, every rank of the job.
    `rng`: this rank's RNG state as it was when the state was taken (default: now). `backing`: where tensors already
    lie in files (an offloaded run's scratch), which are linked into the checkpoint instead of written."""
    root = checkpoint_root(run_dir)
    final = root / step_name(step)
    partial = final.with_name(final.name + ".partial")
    rank = dist.get_rank(group)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        (partial / "rng").mkdir(parents=True)
    barrier(group)
    writer = LinkingWriter(partial, backing) if backing is not None else DigestingWriter(partial)
    dcp.save(state, storage_writer=writer, process_group=group)
    rng_file = f"rng/rank_{rank}.pt"
    with open(partial / rng_file, "wb") as f:
        torch.save(rng if rng is not None else rng_state(), f)
        f.flush()
        os.fsync(f.fileno())
    files = {k: v for part in gather_object(digest_files(partial, [*writer.written, rng_file]), group) for k, v in part.items()}
    if rank == 0:
        files[".metadata"] = file_digest(partial / ".metadata")
        write_json(partial / "meta.json", seal({**meta, "step": step, "world_size": dist.get_world_size(group), "files": files}))
        publish(partial, final)
        prune(root, keep, published=final)
    barrier(group)
    return final


def stage(value: Any) -> Any:
    """A host-memory copy of a DCP state dict, taken now (tensors, and the chunks of chunked tensors, copied)."""
    if hasattr(value, "_chunks"):  # a ChunkedTensor: rebuild it over copies of its chunks
        chunks = [(offsets, t.detach().to("cpu", copy=True)) for offsets, t in value._chunks]
        return type(value)(tuple(value.shape), chunks, dtype=value.dtype, device=torch.device("cpu"))
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: stage(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(stage(v) for v in value)
    return value


class CheckpointSaver:
    """Saves a job's checkpoints, in the background or not; `save` returns how long training stalled for it."""

    def __init__(self, run_dir: str | Path, *, keep: int, group: dist.ProcessGroup, background: bool) -> None:
        self.run_dir, self.keep, self.background = Path(run_dir), keep, background
        ranks = dist.get_process_group_ranks(group)
        # a thread's collectives need a group of their own; only this job's ranks take part in creating it
        self.group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True) if background else group
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.write_s: list[float] = []
        self.reported = 0

    def save(self, state: dict[str, Any], step: int, meta: dict[str, Any], *, backing: Backing | None = None) -> float:
        """Checkpoint `state` as of now; the seconds the caller was held (waiting for the previous save, copying).
        A save with `backing` (files linked, not copied) is never in the background: the files must not change first."""
        t0 = time.perf_counter()
        self.wait()
        if not self.background or backing is not None:
            save_checkpoint(state, self.run_dir, step, meta, keep=self.keep, group=self.group, backing=backing)
            self.write_s.append(time.perf_counter() - t0)
            return self.write_s[-1]
        staged, rng = stage(state), rng_state()
        self.thread = threading.Thread(target=self._write, args=(staged, step, meta, rng), name=f"checkpoint-{step}", daemon=True)
        self.thread.start()
        return time.perf_counter() - t0

    def _write(self, staged: dict[str, Any], step: int, meta: dict[str, Any], rng: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            save_checkpoint(staged, self.run_dir, step, meta, keep=self.keep, group=self.group, rng=rng)
            self.write_s.append(time.perf_counter() - t0)
        except BaseException as err:  # DCP's CheckpointException derives from BaseException
            self.error = err

    def poll(self) -> list[float]:
        """Seconds each background save published since the last poll took (a failed one is raised here)."""
        if self.thread is not None and not self.thread.is_alive():
            self.wait()
        fresh, self.reported = self.write_s[self.reported :], len(self.write_s)
        return fresh

    def wait(self) -> None:
        """Block until the save in flight (if any) is published; its failure is raised here, in one line."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            first = (str(err).strip().splitlines() or [err.__class__.__name__])[0][:300]
            raise BehemothError(
                f"saving a checkpoint in the background failed: {first}",
                "check the run directory's disk, or set checkpoint.async_save=false to save in the training loop",
            )


def write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def publish(partial: Path, final: Path) -> None:
    """Make `partial` the checkpoint `final` and point `latest` at it."""
    if final.exists():
        stale = final.with_name(final.name + ".old")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
        os.replace(partial, final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(partial, final)
    point_latest(final)


def point_latest(ckpt: Path) -> None:
    """Make `latest` (beside `ckpt`) name it, atomically."""
    tmp = ckpt.parent / (LATEST + ".tmp")
    tmp.write_text(ckpt.name + "\n")
    os.replace(tmp, ckpt.parent / LATEST)


def prune(root: Path, keep: int, *, published: Path | None = None) -> None:
    """Keep the newest `keep` checkpoints up to the one just published; later ones belong to a timeline the run left
    when it resumed from an earlier checkpoint, and go too."""
    complete = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())
    if published is not None:
        complete, abandoned = [p for p in complete if p.name <= published.name], [p for p in complete if p.name > published.name]
        for old in abandoned:
            shutil.rmtree(old, ignore_errors=True)
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(ckpt: Path, rank: int, world_size: int, saved_world_size: int) -> None:
    """Each rank's RNG continues where it stopped (its state missing is damage); with a new process count there is no
    such rank, and the run's seed stands."""
    if world_size != saved_world_size:
        return
    path = ckpt / "rng" / f"rank_{rank}.pt"
    if not path.is_file():
        raise CheckpointDamage(ckpt, f"rng/rank_{rank}.pt", "is missing")
    state = torch.load(path, weights_only=True)
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def step_folders(root: Path) -> list[Path]:
    """The complete-looking checkpoint folders under a checkpoints/ folder, newest first."""
    return sorted((p for p in root.glob("step_*") if p.is_dir() and STEP_NAME.fullmatch(p.name)), reverse=True)


def newest_intact(root: Path, *, besides: Path | None = None) -> Path | None:
    """The newest checkpoint under `root` that passes `verify` (other than `besides`), or None."""
    for ckpt in step_folders(root):
        if besides is not None and ckpt.resolve() == besides.resolve():
            continue
        try:
            verify(ckpt)
            return ckpt
        except BehemothError:
            continue
    return None


def offer(root: Path, use: str, *, besides: Path | None = None) -> str:
    """The fix for a damaged checkpoint: the newest intact one beside it, in the words of the command (`use`)."""
    intact = newest_intact(root, besides=besides) if root.is_dir() else None
    if intact is None:
        return f"no intact checkpoint is left in {root}; start a new run"
    return f"the newest intact checkpoint is {intact}: {use.format(intact)}"


def resolve_checkpoint(
    path: str | Path, *, use: str = "--resume {}", missing: str = "point --resume at a run directory that has saved a checkpoint"
) -> Path:
    """A checkpoint folder from a run directory (its latest), a checkpoints/ folder or a step folder. `latest` must
    name a step folder beside it. `use` and `missing`: the fixes offered, in the words of the calling command."""
    p = Path(path)
    if (p / "meta.json").exists() or (p / ".metadata").exists() or STEP_NAME.fullmatch(p.name):
        if not p.is_dir():
            raise BehemothError(f"checkpoint {p} does not exist", offer(p.parent, use))
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    pointer = root / LATEST
    if not pointer.is_file():
        if step_folders(root):
            raise BehemothError(f"{root} has checkpoints but no `latest` pointer", offer(root, use))
        raise BehemothError(f"no checkpoint found at {path}", missing)
    name = pointer.read_text(errors="replace").strip()
    if not STEP_NAME.fullmatch(name) or not (root / name).is_dir():
        raise BehemothError(f"{pointer} names {name[:80]!r}, which is not a checkpoint folder beside it", offer(root, use))
    return root / name


def read_meta(ckpt: Path) -> dict[str, Any]:
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
        if not isinstance(meta, dict):
            raise ValueError("not a mapping")
        return meta
    except (OSError, ValueError) as err:
        raise BehemothError(f"checkpoint {ckpt} has no readable meta.json ({err.__class__.__name__})", "resume from an earlier checkpoint") from None


def validate_checkpoint(ckpt: Path, model_config: dict[str, Any] | None, *, use: str = "--resume {}") -> dict[str, Any]:
    """Refuse, before any worker starts, a checkpoint that is damaged (any file, see `integrity.verify`) or belongs to
    another model; the refusal offers the newest intact checkpoint beside it, as `use` words it."""
    try:
        meta = verify(ckpt)
    except CheckpointDamage as err:
        raise BehemothError(str(err), offer(ckpt.parent, use, besides=ckpt)) from None
    saved = meta.get("config", {}).get("model", {})
    diffs = [
        f"model.{k}: checkpoint {saved.get(k)!r}, config {v!r}"
        for k, v in (model_config or {}).items()
        if k in SHAPE_FIELDS and shape_value(k, saved.get(k)) != shape_value(k, v)
    ]
    if diffs:
        raise BehemothError(f"checkpoint {ckpt} was saved from a different model ({'; '.join(diffs)})", "resume with the checkpoint's model settings")
    return meta


def verify_files(ckpt: Path) -> dict[str, Any]:
    """Every file of checkpoint `ckpt` as it was written (`integrity.verify`), or one line naming the damage and the newest
    intact checkpoint beside it; its meta."""
    return validate_checkpoint(ckpt, None)


def dcp_load(state: dict[str, Any], ckpt: Path, **kwargs: Any) -> None:
    """dcp.load through the allow-listed reader and a planner that loads tensors only (the index is read first, so that a
    refused one is reported as itself rather than inside DCP's CheckpointException)."""
    read_dcp_metadata(ckpt)
    dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)), planner=SafeLoadPlanner(), **kwargs)


def load_checkpoint(state: dict[str, Any], ckpt: Path, group: dist.ProcessGroup) -> None:
    """Fill `state` in place from checkpoint `ckpt`; collective over `group`, every rank of the job."""
    try:
        dcp_load(state, ckpt, process_group=group)
    except BehemothError:
        raise
    except (Exception, CheckpointException) as err:  # surface DCP's failure as one line naming the checkpoint
        first = str(err).strip().splitlines()[0] if str(err).strip() else err.__class__.__name__
        raise BehemothError(
            f"checkpoint {ckpt} could not be loaded: {first[:300]}", "check that it matches this model, or resume from an earlier checkpoint"
        ) from None


def load_consolidated(ckpt: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint `ckpt`'s weights (saved under any layout) loaded into `model` (on meta, built single-process) on the
    CPU, in one process; its state dict."""
    model.to_empty(device="cpu")
    state = model.state_dict()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load({"model": state}, ckpt, no_dist=True)
    except BehemothError:
        raise
    except (Exception, CheckpointException) as err:
        first = (str(err).strip().splitlines() or [err.__class__.__name__])[0][:200]
        raise BehemothError(f"checkpoint {ckpt} does not hold this model's weights ({first})", "export with the run's own config") from None
    return state


SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float64: "F64",
}


def export_safetensors(ckpt: Path, out: Path, model: torch.nn.Module) -> Path:
    """Consolidated weights of checkpoint `ckpt` as one safetensors file (single process, any layout), written tensor by
    tensor: `model` (on meta) only names the tensors, and memory holds one tensor at a time, whatever the model's size."""
    meta = read_meta(ckpt)
    again = {name for others in tied_names(model).values() for name in others}  # a tied weight is written once, first name
    specs = {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in again}
    header: dict[str, Any] = {"__metadata__": {"config": json.dumps(meta.get("config", {}).get("model", {})), "step": str(meta.get("step"))}}
    at = 0
    for name, t in specs.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for batch in export_batches(specs):
            for value in load_tensors(ckpt, batch).values():
                f.write(value.contiguous().view(torch.uint8).numpy().tobytes() if value.numel() else b"")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out


EXPORT_BATCH_BYTES = 256 * 2**20  # memory holds at most this much of the model at once (or one larger tensor)


def export_batches(specs: dict[str, torch.Tensor], limit: int = EXPORT_BATCH_BYTES) -> list[dict[str, torch.Tensor]]:
    """The tensors in order, in runs of at most `limit` bytes: one checkpoint read per run, not per tensor."""
    batches: list[dict[str, torch.Tensor]] = [{}]
    held = 0
    for name, t in specs.items():
        n = t.numel() * t.element_size()
        if batches[-1] and held + n > limit:
            batches.append({})
            held = 0
        batches[-1][name] = t
        held += n
    return [b for b in batches if b]


def load_tensors(ckpt: Path, likes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Consolidated model tensors of checkpoint `ckpt` (saved under any layout), in one process, in `likes`' order."""
    values = {name: torch.empty(like.shape, dtype=like.dtype) for name, like in likes.items()}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load({"model": values}, ckpt, no_dist=True)
    except BehemothError:
        raise
    except (Exception, CheckpointException) as err:
        first = (str(err).strip().splitlines() or [err.__class__.__name__])[0][:200]
        names = ", ".join(list(likes)[:3]) + (", ..." if len(likes) > 3 else "")
        raise BehemothError(f"checkpoint {ckpt} does not hold this model's {names} ({first})", "export with the run's own config") from None
    return values


def export_pretrained(ckpt: Path, out: Path, model: torch.nn.Module) -> Path:
    """A checkpoint of a transformers model (saved under any layout) as a save_pretrained folder, written by transformers
    itself in its own layout (a Mixtral's experts as per-expert w1/w2/w3), so `from_pretrained` and hf.weights load it."""
    if not hasattr(model, "save_pretrained"):
        raise BehemothError("export --hf needs a run of a transformers model (model=hf:...)", "export behemoth's GPT without --hf")
    load_consolidated(ckpt, model)
    model.save_pretrained(str(out))
    return out
