"""Offloaded inference (ZeRO-Inference style): a model larger than memory generates with its blocks' weights streamed.

The embedding, final norm and head stay resident; each transformer block's weights live in host memory
(tier `cpu`) or on disk (`disk`; training's tier names), in a folder of one safetensors file per block, and are read just before the block runs and
dropped right after, while a background thread reads the next `prefetch` blocks. So memory holds the
resident parts, `prefetch + 1` blocks, the KV cache and the activations, whatever the depth. Every
forward reads every block once for the whole batch, so a larger batch amortises each read: the time of
a forward is bounded below by (bytes of the blocks) / (bandwidth of the tier), which the benchmark
prints next to the measured time.

The folder is written part by part from any source (a DCP checkpoint read one block at a time, a
Hugging Face folder, or weights drawn from a config's seed), so converting never holds the whole model
either. Disk reads drop the file from the page cache afterwards, so a model larger than memory is
read from the disk each time rather than from a cache that cannot hold it.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from behemoth.errors import BehemothError
from behemoth.inference.loading import Source
from behemoth.models.causal_lm import CausalLM
from behemoth.models.init import draw_full
from behemoth.offload.tiers import OLDER_SPELLINGS, TIER_NAMES, tier_name

if TYPE_CHECKING:
    from behemoth.inference.generate import CachePolicy, Generator


STREAM_TIERS = tuple(t for t in (*TIER_NAMES, *OLDER_SPELLINGS) if tier_name(t) != "device")  # where blocks wait: offload.params tiers


@dataclass(frozen=True)
class OffloadPolicy:
    """Where the blocks' weights wait (`cpu`: host memory, or `disk`: training's tier names), the folder on disk, and how
    many blocks to read ahead."""

    tier: str = "disk"
    folder: str | None = None
    prefetch: int = 1

    def __post_init__(self) -> None:
        if self.tier not in STREAM_TIERS or self.prefetch < 0:
            raise BehemothError(
                f"offload tier {self.tier!r} with prefetch {self.prefetch}",
                f"use a tier of {', '.join(STREAM_TIERS)} (host memory, files) and prefetch >= 0",
            )


def parts_of(lm: CausalLM, blocks: str) -> dict[str, dict[str, nn.Parameter]]:
    """Single-process parameter names by part: 'resident' (all but the blocks) and 'block.I' for every block."""
    parts: dict[str, dict[str, nn.Parameter]] = {"resident": {}}
    for name, p in lm.module.named_parameters():
        if name.startswith(blocks + "."):
            index = int(name[len(blocks) + 1 :].split(".")[0])
            parts.setdefault(f"block.{index}", {})[name] = p
        else:
            parts["resident"][name] = p
    return parts


class SourceReader:
    """Full single-process tensors of named parameters from a source: a DCP checkpoint, an HF folder, or the seed."""

    def __init__(self, source: Source, lm: CausalLM) -> None:
        self.source, self.lm = source, lm
        self.files = sorted(Path(source.config.hf.weights).expanduser().glob("*.safetensors")) if source.config.hf.weights else []

    def read(self, params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
        if self.source.checkpoint is not None:
            return self._from_checkpoint(params)
        if self.files:
            return self._from_safetensors(params)
        seed = self.source.config.train.seed
        return {n: draw_full(self.lm.init_spec(n), tuple(p.shape), seed, n).to(p.dtype) for n, p in params.items()}

    def _from_checkpoint(self, params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
        from behemoth.faults.checkpoint import dcp_load  # DCP's index read through the allow-list

        state = {n: torch.empty(p.shape, dtype=p.dtype) for n, p in params.items()}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load({"model": state}, self.source.checkpoint, no_dist=True)
        return state

    def _from_safetensors(self, params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
        """The HF folder's tensors through the one reader models/hf.py loads with (a Mixtral's legacy per-expert
        tensors stacked as they are there)."""
        from behemoth.models.hf import stored_tensors

        model_type = getattr(getattr(self.lm.module, "config", None), "model_type", None)
        out = {k: t.to(params[k].dtype) for k, t in stored_tensors(self.files, set(params), model_type)}
        missing = sorted(set(params) - set(out))
        if missing:
            raise BehemothError(f"hf.weights={self.source.config.hf.weights} lacks {missing[0]}", "save the whole model")
        return out


class HostStore:
    """Every block's weights in host memory (pinned where an accelerator can copy from it asynchronously)."""

    def __init__(self) -> None:
        self.parts: dict[str, dict[str, torch.Tensor]] = {}

    def put(self, part: str, tensors: dict[str, torch.Tensor]) -> None:
        pin = torch.cuda.is_available()
        self.parts[part] = {n: t.pin_memory() if pin else t for n, t in tensors.items()}

    def read(self, part: str) -> dict[str, torch.Tensor]:
        return self.parts[part]


class DiskStore:
    """Every block's weights in a safetensors file of its own, read whole (one sequential read) and dropped from the
    page cache afterwards."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def path(self, part: str) -> Path:
        return self.folder / f"{part}.safetensors"

    def put(self, part: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        save_file({n: t.contiguous() for n, t in tensors.items()}, str(self.path(part)))
        drop_page_cache(self.path(part))

    def read(self, part: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        path = self.path(part)
        data = path.read_bytes()
        drop_page_cache(path)
        return load(data)


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to forget a file's cached pages (so the next read comes from the disk)."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            if hasattr(os, "fdatasync"):
                os.fdatasync(fd)  # written pages must be on the disk before they can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@dataclass
class StreamStats:
    """Measured: bytes read, seconds spent reading (background) and waiting for reads (foreground), peak bytes held."""

    bytes_read: int = 0
    read_s: float = 0.0
    wait_s: float = 0.0
    held: int = 0
    peak_held: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int, seconds: float = 0.0) -> None:
        with self.lock:
            self.held += nbytes
            self.peak_held = max(self.peak_held, self.held)
            if nbytes > 0:
                self.bytes_read += nbytes
                self.read_s += seconds


class LayerStreamer:
    """Block weights in just before a block runs and out right after; the next `prefetch` blocks read on a thread."""

    def __init__(
        self, model: nn.Module, blocks: str, layers: tuple[int, ...], store: HostStore | DiskStore, device: torch.device, prefetch: int
    ) -> None:
        self.layers, self.store, self.device, self.prefetch = layers, store, device, prefetch
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="behemoth-prefetch")
        self.pending: dict[int, Future] = {}
        self.stats = StreamStats()
        modules = model.get_submodule(blocks)
        self.slots = {
            i: [
                (owner, pname, f"{blocks}.{i}.{mname}.{pname}".replace("..", "."), p.shape, p.dtype)
                for mname, owner in modules[i].named_modules()
                for pname, p in owner.named_parameters(recurse=False)
            ]
            for i in layers
        }

    def _fetch(self, i: int) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        tensors = {n: t.to(self.device, non_blocking=True) for n, t in self.store.read(f"block.{i}").items()}
        self.stats.add(sum(t.numel() * t.element_size() for t in tensors.values()), time.perf_counter() - t0)
        return tensors

    def _ensure(self, i: int) -> None:
        if i not in self.pending:
            self.pending[i] = self.pool.submit(self._fetch, i)

    def load(self, i: int) -> None:
        """Block i's weights in place (waiting for its read if it is not done), and the next blocks' reads started."""
        self._ensure(i)
        at = self.layers.index(i)
        for k in range(1, self.prefetch + 1):
            self._ensure(self.layers[(at + k) % len(self.layers)])
        t0 = time.perf_counter()
        tensors = self.pending.pop(i).result()
        self.stats.wait_s += time.perf_counter() - t0
        for owner, pname, full, _, _ in self.slots[i]:
            owner._parameters[pname] = nn.Parameter(tensors[full], requires_grad=False)

    def release(self, i: int) -> None:
        """Drop block i's weights (back to shapes on the meta device)."""
        freed = 0
        for owner, pname, _, shape, dtype in self.slots[i]:
            p = owner._parameters[pname]
            freed += p.numel() * p.element_size()
            owner._parameters[pname] = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
        self.stats.add(-freed)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def write_parts(reader: SourceReader, parts: dict[str, dict[str, nn.Parameter]], store: HostStore | DiskStore) -> int:
    """Every block's weights from the source into the store, one block at a time; the bytes written."""
    total = 0
    for part, params in parts.items():
        if part == "resident":
            continue
        tensors = reader.read(params)
        store.put(part, tensors)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    return total


@torch.no_grad()
def install_resident(lm: CausalLM, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """The resident parameters (embedding, norms, head) in place; a tied head keeps sharing the embedding's parameter."""
    model = lm.module
    replaced: dict[int, nn.Parameter] = {}
    for name, t in tensors.items():
        owner_name, _, pname = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        replaced[id(owner._parameters[pname])] = nn.Parameter(t.to(device), requires_grad=False)
    for owner in model.modules():
        for pname, p in list(owner._parameters.items()):
            if p is not None and id(p) in replaced:
                owner._parameters[pname] = replaced[id(p)]
    lm.after_materialize(device)


@dataclass
class Offloaded:
    """A generator over an offloaded model, its streamer (with measured statistics) and the bytes it streams per forward."""

    generator: Generator
    streamer: LayerStreamer
    streamed_bytes: int
    resident_bytes: int
    folder: Path | None

    def close(self) -> None:
        self.streamer.close()


def offloaded_generator(source: Source, policy: OffloadPolicy, cache: CachePolicy, *, device: torch.device | None = None) -> Offloaded:
    """A single-process Generator whose blocks stream from `policy.tier`; the resident parts and the KV cache on `device`."""
    from behemoth.inference.generate import Generator
    from behemoth.inference.kv_cache import KVStorage, blocks_for_memory
    from behemoth.inference.runner import ModelRunner, cache_layout
    from behemoth.inference.text import tokenizer_for
    from behemoth.models.causal_lm import build_causal_lm

    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    cfg = source.config
    lm = build_causal_lm(cfg.model, cfg.hf)
    lm.weights = None
    blocks = lm.layers.blocks
    parts, reader = parts_of(lm, blocks), SourceReader(source, lm)
    folder = Path(policy.folder) if policy.folder else None
    if policy.tier == "disk" and folder is None:
        raise BehemothError("disk offload needs a folder for the blocks' weights", "pass --offload-dir DIR")
    store = DiskStore(folder) if policy.tier == "disk" else HostStore()
    streamed = write_parts(reader, parts, store)
    install_resident(lm, reader.read(parts["resident"]), device)
    layers = tuple(range(lm.shape.n_layer))
    streamer = LayerStreamer(lm.module, blocks, layers, store, device, policy.prefetch)
    dtype = next(iter(parts["resident"].values())).dtype
    probe = cache_layout(lm, layers=layers, tp=1, block_size=cache.block_size, num_blocks=1, dtype=dtype)
    layout = cache_layout(
        lm,
        layers=layers,
        tp=1,
        block_size=cache.block_size,
        dtype=dtype,
        num_blocks=blocks_for_memory(int(cache.memory_mb * 2**20), probe.bytes_per_block),
    )
    runner = ModelRunner(lm, KVStorage(layout, device), device=device, stream=streamer)
    gen = Generator(
        runner,
        num_blocks=layout.num_blocks,
        block_size=cache.block_size,
        context=lm.shape.context,
        tokenizer=tokenizer_for(lm.shape.vocab_size, source.folder),
        eos_token_ids=source.eos_token_ids,
    )
    resident = sum(p.numel() * p.element_size() for p in lm.module.parameters() if not p.is_meta)
    return Offloaded(gen, streamer, streamed, resident, folder)
