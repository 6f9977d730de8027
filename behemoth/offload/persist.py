"""What a checkpoint of an offloaded run needs from its tiers: the files behind its tensors, and how to take them back.

- `backing(sync)`: for `LinkingWriter`, where a state-dict tensor's bytes lie in the disk tier's scratch, so the
  checkpoint links the file (at a step boundary every scratch file is consistent) instead of writing the bytes;
  the tier's next write of that file goes to a new one (copy-on-write), so the checkpoint keeps what it linked.
- `adoptable(sync, state, ckpt)` / `adopt(...)`: at a resume under the same layout, the checkpoint's linked files
  become the scratch again by hard links: nothing is read or copied, and nothing is mapped into memory.
- `load_8bit_across_layouts`: 8-bit Adam state is saved as it is stored (codes and block scales of each rank's
  shard); another layout dequantizes the saved ranks' blocks and quantizes them into its own.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from behemoth.errors import BehemothError
from behemoth.faults.integrity import RAW, Backing, read_dcp_metadata
from behemoth.parallel.zero.adam import ShardPiece
from behemoth.parallel.zero.layout import FlatLayout
from behemoth.parallel.zero.tiers import FileTier

SCRATCH = "scratch"  # the folder of a checkpoint that holds the linked scratch files


def file_tiers(sync: Any) -> list[FileTier]:
    return [t for t in sync.tiers.all().values() if isinstance(t, FileTier)]


def backing(sync: Any) -> Backing:
    """Where a tensor of the sync's state dict lies in a scratch file: (name in the checkpoint, byte offset, link)."""
    tiers = file_tiers(sync)

    def find(t: torch.Tensor) -> tuple[str, int, Any] | None:
        for tier in tiers:
            hit = tier.backing(t)
            if hit is not None:
                key, offset = hit
                name = f"{SCRATCH}/{tier.root.relative_to(sync.root).as_posix()}/{key}.bin"
                return name, offset, functools.partial(tier.link, key)
        return None

    return find


def forget_views(sync: Any) -> None:
    """The state dict's memory maps are done with (saved or loaded)."""
    for tier in file_tiers(sync):
        tier.forget_views()


def chunks_of(state: dict[str, Any]) -> list[tuple[str, tuple[int, ...], torch.Tensor]]:
    """(fqn, offsets, tensor) of every chunk DCP would write for `state`."""
    flat, _ = flatten_state_dict(state)
    out = []
    for fqn, value in flat.items():
        if hasattr(value, "_chunks"):
            out += [(fqn, tuple(offsets), t) for offsets, t in value._chunks]
        elif torch.is_tensor(value):
            out.append((fqn, (0,) * value.dim(), value))
    return out


def adoptable(sync: Any, state: dict[str, Any], ckpt: Path) -> dict[str, tuple[FileTier, str]] | None:
    """The checkpoint files that hold exactly this rank's file-backed tensors at the same byte offsets (name -> (tier, key)),
    or None when any tensor is stored elsewhere or otherwise (another layout: load through DCP)."""
    storage = {(i.fqn, tuple(i.offset or ())): info for i, info in (read_dcp_metadata(ckpt).storage_data or {}).items()}
    find, tiers = backing(sync), file_tiers(sync)
    out: dict[str, tuple[FileTier, str]] = {}
    for fqn, offsets, t in chunks_of(state):
        hit = find(t)
        if hit is None:
            continue
        name, offset, _ = hit
        info = storage.get((fqn, offsets))
        if info is None or str(info.relative_path) != name or info.offset != offset or RAW not in (info.transform_descriptors or ()):
            return None
        tier = next(tr for tr in tiers if tr.backing(t) is not None)
        out[name] = (tier, tier.backing(t)[0])
    return out


def adopt(files: dict[str, tuple[FileTier, str]], ckpt: Path) -> None:
    """Hard-link the checkpoint's files back as the scratch (`adoptable`'s answer)."""
    for name, (tier, key) in files.items():
        tier.adopt(key, ckpt / name)


def without_backed(state: dict[str, Any], sync: Any) -> dict[str, Any]:
    """`state` without the entries whose every chunk lies in a scratch file (restored by adoption instead)."""
    find = backing(sync)

    def keep(value: Any) -> bool:
        chunks = [t for _, t in value._chunks] if hasattr(value, "_chunks") else [value] if torch.is_tensor(value) else None
        return chunks is None or not chunks or any(find(t) is None for t in chunks)

    def prune(d: dict[str, Any]) -> dict[str, Any]:
        out = {k: prune(v) if isinstance(v, dict) else v for k, v in d.items() if isinstance(v, dict) or keep(v)}
        return {k: v for k, v in out.items() if not (isinstance(v, dict) and not v)}

    return prune(state)


def eight_bit_keys(state: dict[str, Any], prefix: str) -> list[str]:
    return [k for k in state.get("optim", {}) if k.startswith(prefix + ".dp")]


def missing_8bit(state: dict[str, Any], ckpt: Path, prefix: str) -> list[str]:
    """This layout's 8-bit optimizer entries that the checkpoint does not hold (it was saved under another layout)."""
    saved = read_dcp_metadata(ckpt).state_dict_metadata
    return [k for k in eight_bit_keys(state, prefix) if f"optim.{k}.m" not in saved]


def load_8bit_across_layouts(sync: Any, ckpt: Path, prefix: str) -> None:
    """Fill each unit's 8-bit moments from a checkpoint saved under another data-parallel layout: the saved ranks'
    blocks dequantized (their pieces follow from the saved world size), cut to this rank's pieces, quantized again."""
    from behemoth.faults.checkpoint import dcp_load

    saved = read_dcp_metadata(ckpt).state_dict_metadata
    worlds = {int(k.split(".")[2][2:]) for k in saved if k.startswith(f"optim.{prefix}.dp")}
    if len(worlds) != 1:
        raise BehemothError(
            f"checkpoint {ckpt} holds no 8-bit Adam state (offload.optimizer_bits=8) to resume from",
            "resume with the optimizer settings it was saved with",
        )
    world = worlds.pop()
    for store in sync.stores:
        m, v = torch.zeros(store.shard_size), torch.zeros(store.shard_size)
        saved_layout = FlatLayout(store.layout.names, store.layout.shapes, world)
        for rank in range(world):
            theirs = saved_layout.pieces(rank)
            if not any(q.index == pc.index for q in theirs for pc in store.raw_pieces):
                continue
            fqn = f"{prefix}.dp{world}.rank{rank}.unit{store.index}"
            part = {k: torch.empty(tuple(saved[f"optim.{fqn}.{k}"].size), dtype=saved[f"optim.{fqn}.{k}"].properties.dtype) for k in store.state_keys}
            dcp_load({"optim": {fqn: part}}, ckpt, no_dist=True)
            pieces = [ShardPiece(q.shard_offset, q.numel, False) for q in theirs]
            m_r, v_r = store.adam.moments({k: t.to(sync.rt.device) for k, t in part.items()}, pieces)
            for q in theirs:
                for pc in store.raw_pieces:
                    lo, hi = max(q.start, pc.start), min(q.stop, pc.stop)
                    if pc.index == q.index and lo < hi:
                        mine, src = (
                            slice(pc.shard_offset + lo - pc.start, pc.shard_offset + hi - pc.start),
                            slice(q.shard_offset + lo - q.start, q.shard_offset + hi - q.start),
                        )
                        m[mine], v[mine] = m_r[src].cpu(), v_r[src].cpu()
        state = {k: sync.tiers.optimizer.fetch(key) for k, key in store.state_keys.items()}
        store.adam.load_moments(state, m.to(sync.rt.device), v.to(sync.rt.device), store.pieces)
        for k, key in store.state_keys.items():
            sync.tiers.optimizer.store(key, state[k])
