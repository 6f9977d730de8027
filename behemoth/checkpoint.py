"""Checkpoints through torch.distributed.checkpoint (DCP), written atomically.

Layout of a run directory's `checkpoints/` folder:

    step_0000100/          a complete checkpoint: DCP files (.metadata, __*_*.distcp), meta.json, rng/
    step_0000100.partial/  a checkpoint being written; never read, removed on the next save
    latest                 text: the name of the newest complete checkpoint

All ranks write into `step_N.partial/`; rank 0 adds meta.json, renames the folder and then swaps
`latest`, so a crash at any moment leaves the previous checkpoint loadable. Tensors are saved by
their names in the single-process model, so a checkpoint loads under any number of processes.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from behemoth.errors import BehemothError
from behemoth.models.causal_lm import tied_names

LATEST = "latest"
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


def save_checkpoint(state: dict[str, Any], run_dir: str | Path, step: int, meta: dict[str, Any], *, keep: int,
                    group: dist.ProcessGroup) -> Path:
    """Write `state` (a DCP state dict) as checkpoint `step`; collective over `group`, every rank of the job."""
    root = checkpoint_root(run_dir)
    final = root / step_name(step)
    partial = final.with_name(final.name + ".partial")
    rank = dist.get_rank(group)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        (partial / "rng").mkdir(parents=True)
    dist.barrier(group=group)
    dcp.save(state, checkpoint_id=str(partial), process_group=group)
    torch.save(rng_state(), partial / "rng" / f"rank_{rank}.pt")
    dist.barrier(group=group)
    if rank == 0:
        write_json(partial / "meta.json", {**meta, "step": step, "world_size": dist.get_world_size(group)})
        publish(partial, final)
        prune(root, keep)
    dist.barrier(group=group)
    return final


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
    tmp = final.parent / (LATEST + ".tmp")
    tmp.write_text(final.name + "\n")
    os.replace(tmp, final.parent / LATEST)


def prune(root: Path, keep: int) -> None:
    complete = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(ckpt: Path, rank: int, world_size: int, saved_world_size: int) -> None:
    """Each rank's RNG continues where it stopped; with a new process count there is no such rank."""
    path = ckpt / "rng" / f"rank_{rank}.pt"
    if world_size != saved_world_size or not path.exists():
        return
    state = torch.load(path, weights_only=True)
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a run directory (its latest), a checkpoints/ folder or a step folder."""
    p = Path(path)
    if (p / "meta.json").exists() or (p / ".metadata").exists():
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    pointer = root / LATEST
    if not pointer.exists():
        raise BehemothError(f"no checkpoint found at {path}", "point --resume at a run directory that has saved a checkpoint")
    ckpt = root / pointer.read_text().strip()
    if not ckpt.is_dir():
        raise BehemothError(f"{pointer} names {ckpt.name}, which does not exist", "the run directory is damaged; resume from a step_* folder by path")
    return ckpt


def read_meta(ckpt: Path) -> dict[str, Any]:
    try:
        return json.loads((ckpt / "meta.json").read_text())
    except (OSError, ValueError) as err:
        raise BehemothError(f"checkpoint {ckpt} has no readable meta.json ({err.__class__.__name__})", "resume from an earlier checkpoint") from None


def verify_files(ckpt: Path) -> None:
    """Check before launch that DCP's index is readable and every byte range it names exists."""
    try:
        metadata = FileSystemReader(str(ckpt)).read_metadata()
    except Exception as err:  # DCP raises several types for a damaged index
        raise BehemothError(f"checkpoint {ckpt} is corrupt: its .metadata cannot be read ({err.__class__.__name__})", "resume from an earlier checkpoint") from None
    for info in (metadata.storage_data or {}).values():
        f = ckpt / info.relative_path
        need = info.offset + info.length
        if not f.exists() or f.stat().st_size < need:
            have = f.stat().st_size if f.exists() else "no"
            raise BehemothError(f"checkpoint {ckpt} is corrupt: {f.name} has {have} bytes, needs {need}", "resume from an earlier checkpoint")


def validate_checkpoint(ckpt: Path, model_config: dict[str, Any]) -> dict[str, Any]:
    """Refuse, before any worker starts, a checkpoint that is damaged or belongs to another model."""
    meta = read_meta(ckpt)
    verify_files(ckpt)
    saved = meta.get("config", {}).get("model", {})
    diffs = [f"model.{k}: checkpoint {saved.get(k)!r}, config {v!r}" for k, v in model_config.items()
             if k in SHAPE_FIELDS and shape_value(k, saved.get(k)) != shape_value(k, v)]
    if diffs:
        raise BehemothError(f"checkpoint {ckpt} was saved from a different model ({'; '.join(diffs)})", "resume with the checkpoint's model settings")
    return meta


def load_checkpoint(state: dict[str, Any], ckpt: Path, group: dist.ProcessGroup) -> None:
    """Fill `state` in place from checkpoint `ckpt`; collective over `group`, every rank of the job."""
    try:
        dcp.load(state, checkpoint_id=str(ckpt), process_group=group)
    except Exception as err:  # surface DCP's failure as one line naming the checkpoint
        first = str(err).strip().splitlines()[0] if str(err).strip() else err.__class__.__name__
        raise BehemothError(f"checkpoint {ckpt} could not be loaded: {first[:300]}", "check that it matches this model, or resume from an earlier checkpoint") from None


def load_consolidated(ckpt: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint `ckpt`'s weights (saved under any layout) loaded into `model` (on meta, built single-process) on the
    CPU, in one process; its state dict."""
    model.to_empty(device="cpu")
    state = model.state_dict()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    except Exception as err:
        raise BehemothError(f"checkpoint {ckpt} does not hold this model's weights ({str(err).splitlines()[0][:200]})", "export with the run's own config") from None
    return state


def export_safetensors(ckpt: Path, out: Path, model: torch.nn.Module) -> Path:
    """Consolidated weights of checkpoint `ckpt` as one safetensors file (single process, any layout)."""
    from safetensors.torch import save_file

    state = load_consolidated(ckpt, model)
    meta = read_meta(ckpt)
    tmp = out.with_suffix(".tmp")
    again = {name for others in tied_names(model).values() for name in others}  # a tied weight is written once, first name
    tensors = {k: v.contiguous() for k, v in state.items() if k not in again}
    save_file(tensors, str(tmp), metadata={"config": json.dumps(meta.get("config", {}).get("model", {})), "step": str(meta.get("step"))})
    os.replace(tmp, out)
    return out


def export_pretrained(ckpt: Path, out: Path, model: torch.nn.Module) -> Path:
    """A checkpoint of a transformers model (saved under any layout) as a save_pretrained folder, written by transformers
    itself in its own layout (a Mixtral's experts as per-expert w1/w2/w3), so `from_pretrained` and hf.weights load it."""
    if not hasattr(model, "save_pretrained"):
        raise BehemothError("export --hf needs a run of a transformers model (model=hf:...)", "export behemoth's GPT without --hf")
    load_consolidated(ckpt, model)
    model.save_pretrained(str(out))
    return out
