"""Process topology: named parallel degrees, the process group and the DeviceMesh built from them.

Nothing here is global: `init_runtime` returns a `Runtime` that is passed to whoever needs it, and
every collective of a job runs on the runtime's groups (its mesh dimensions, or `world_group`: all of
its ranks), never on the default group. So several models can train side by side in one world, each
on its own sub-mesh (`init_runtime(models=2)`: two independent jobs on the two halves of the world).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from behemoth.comm import all_reduce
from behemoth.errors import BehemothError

MESH_DIMS = ("pp", "dp", "cp", "ep", "tp")
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_host_memory() -> bool:
    """Have the C library keep the host memory a training process frees, for its next allocations, instead of
    returning it to the OS: glibc serves blocks over its mmap threshold (32 MiB at most, 128 KiB at first) by mmap and
    gives them back at free, and trims the heap's free top, so every step's large tensors (activations, logits chunks,
    the vocabulary-sized gradients) were page-faulted and zero-filled again, page by page: 200-470 thousand faults and
    0.4-3 s of system time per gpt2-124m step here (docs/performance.md). Large blocks then come from the heap, which is
    never trimmed; the process's resident memory stays at its peak. True where the setting took (Linux with glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # another C library (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, -1))  # -1: never trim (mallopt(3))


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of pipeline, data, expert, tensor and context parallelism; their product is the world size.
    Context-parallel ranks (cp) hold one sequence between them: the same parameters and the same sequences as each
    other, different tokens of them."""

    world_size: int
    pp: int = 1
    dp: int = 1
    ep: int = 1
    tp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        bad = [f"{n}={getattr(self, n)}" for n in MESH_DIMS if getattr(self, n) < 1]
        if bad:
            raise BehemothError(f"parallel degrees must be >= 1, got {', '.join(bad)}", "set each degree to a positive integer")
        product = self.pp * self.dp * self.cp * self.ep * self.tp
        if product != self.world_size:
            factors = " x ".join(f"{n}={getattr(self, n)}" for n in MESH_DIMS if n != "cp" or self.cp != 1)
            raise BehemothError(
                f"{factors} = {product}, but the world size is {self.world_size}",
                f"choose degrees whose product is {self.world_size} or launch {product} processes",
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in MESH_DIMS)

    @property
    def data_ranks(self) -> int:
        """Ranks that see different parts of a step's batch: dp x ep (expert-parallel ranks route different tokens)."""
        return self.dp * self.ep

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A 5-D DeviceMesh (pp, dp, cp, ep, tp), tensor parallel innermost so its ranks are neighbours."""
        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)


@dataclass
class Runtime:
    """What one process knows about its job: its rank in it, device, mesh, degrees and the group of all its ranks."""

    rank: int  # rank within this job (0 .. world_size-1)
    world_size: int  # processes of this job
    local_rank: int
    device: torch.device
    dims: ParallelDims
    mesh: DeviceMesh
    world_group: dist.ProcessGroup = field(repr=False)
    owns_process_group: bool = field(default=False, repr=False)
    flattened: dict[str, dist.ProcessGroup] = field(default_factory=dict, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def group(self, dim: str) -> dist.ProcessGroup:
        """The process group of one mesh dimension (`pp`, `dp`, `ep` or `tp`)."""
        return self.mesh.get_group(dim)

    def coordinate(self, dim: str) -> int:
        """This rank's index along one mesh dimension."""
        return self.mesh.get_local_rank(dim)

    def data_group(self) -> dist.ProcessGroup:
        """The ranks of dp x cp x ep (this rank's pp and tp fixed): they hold the same dense parameters and different
        tokens (cp ranks: different parts of the same sequences). The dp group itself when cp and ep are 1; otherwise
        created on first use, which every rank of the job must reach."""
        return self._flat_group(("dp", "cp", "ep"))

    def expert_data_group(self) -> dist.ProcessGroup:
        """The ranks of dp x cp (this rank's pp, ep and tp fixed): they hold the same experts and different tokens, over
        which expert gradients are summed. The dp group itself when cp is 1."""
        return self._flat_group(("dp", "cp"))

    def _flat_group(self, among: tuple[str, ...]) -> dist.ProcessGroup:
        dims = tuple(d for d in among if d == "dp" or getattr(self.dims, d) > 1)
        if len(dims) == 1:
            return self.group("dp")
        name = "_".join(dims)
        if name not in self.flattened:
            self.flattened[name] = self.mesh[dims]._flatten(name).get_group()
        return self.flattened[name]

    def data_rank(self) -> int:
        """This rank's index among the dp x ep ranks: which share of the batch it reads."""
        return self.coordinate("dp") * self.dims.ep + self.coordinate("ep")

    def close(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def pick_device(local_rank: int) -> torch.device:
    """CUDA device `local_rank` where GPUs exist, otherwise the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_runtime(*, timeout_s: float = 300.0, models: int = 1, **degrees: int) -> Runtime:
    """Join (or create) the process group and build this rank's mesh.

    Under torchrun or `behemoth train --nproc N` the rendezvous comes from the environment; a plain
    single process gets a one-rank group on an in-memory store so that every code path is the same.
    `degrees` gives pp/ep/tp; dp defaults to what is left of each job's share of the world.
    `models` > 1 splits the world into that many equal, independent jobs (consecutive ranks); each rank
    gets the runtime of its own job.
    """
    device = pick_device(int(os.environ.get("LOCAL_RANK", 0)))
    owns = join_process_group(device, timeout_s)
    world = dist.get_world_size()
    if models < 1 or world % models:
        raise BehemothError(f"{models} models do not split a world of {world} processes", f"use a number of models that divides {world}")
    dims = resolve_dims(world // models, **degrees)
    if models == 1:
        mesh, group = dims.build_mesh(device.type), dist.group.WORLD
    else:
        full = init_device_mesh(device.type, (models, *dims.shape), mesh_dim_names=("model", *MESH_DIMS))
        mesh = full[MESH_DIMS]
        groups = [dist.new_group(ranks) for ranks in full.mesh.reshape(models, -1).tolist()]  # every rank creates every group
        group = groups[dist.get_rank() // dims.world_size]
        all_reduce(torch.zeros(1, device=device), group)  # its communicator, as warm_up_groups does for the mesh
    warm_up_groups(mesh, device)
    return Runtime(dist.get_rank(group), dims.world_size, int(os.environ.get("LOCAL_RANK", 0)), device, dims, mesh, group, owns)


def one_rank_runtime(rt: Runtime, timeout_s: float) -> Runtime:
    """A runtime of this process alone (a one-rank job of its own), for a model one rank holds whole beside the job's
    sharded one (speculative decoding's draft on job rank 0). Collective: every rank of `rt`'s job calls it, in the
    same order, since each one-rank group is created by all ranks."""
    if rt.world_size == 1:
        return rt
    return init_runtime(timeout_s=timeout_s, models=rt.world_size)


def join_process_group(device: torch.device, timeout_s: float) -> bool:
    """Initialize the default process group unless it exists; True if this call created it."""
    if dist.is_initialized():
        return False
    timeout = datetime.timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in os.environ:  # with a CUDA device_id, NCCL creates its communicator now, not at first use
        dist.init_process_group(
            backend_for(device),
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    else:
        dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return True


def warm_up_groups(mesh: DeviceMesh, device: torch.device) -> None:
    """One tiny all-reduce in every mesh dimension's group, on every rank, before any other traffic.

    NCCL creates a group's communicator at its first operation, and a `batch_isend_irecv` that is a
    group's first operation must include every rank of the group (torch's documented rule); the
    pipeline's first transfers involve only neighbours. Creating all communicators here, in the same
    order on every rank, also makes a broken rendezvous fail at start rather than mid-step.
    """
    for dim in mesh.mesh_dim_names or ():
        if mesh.size(mesh.mesh_dim_names.index(dim)) > 1:
            all_reduce(torch.zeros(1, device=device), mesh.get_group(dim))


def resolve_dims(world_size: int, *, pp: int = 1, ep: int = 1, tp: int = 1, cp: int = 1, dp: int | None = None) -> ParallelDims:
    """Fill in the data-parallel degree from the world size when it is not given."""
    if dp is None:
        rest = pp * cp * ep * tp
        if rest < 1 or world_size % rest:
            named = f"pp={pp} x ep={ep} x tp={tp}" + (f" x cp={cp}" if cp != 1 else "")
            raise BehemothError(f"{named} = {rest} does not divide the world size {world_size}", f"choose degrees whose product divides {world_size}")
        dp = world_size // rest
    return ParallelDims(world_size=world_size, pp=pp, dp=dp, ep=ep, tp=tp, cp=cp)
