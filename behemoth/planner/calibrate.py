"""`behemoth calibrate`: measure this machine and describe it as a `ClusterSpec` (the one part of the planner that
runs processes).

Over N local processes (every GPU, or N CPU processes sharing the cores as training would), all at once:
the matrix-multiply rate by size and dtype, each collective's time by message size (all-reduce, all-gather,
reduce-scatter, all-to-all, p2p), fitted to latency + bytes / bus bandwidth in nccl-tests' convention, the memory
bandwidth of a large copy, the cost of one tiny operator and of an AdamW step per parameter element, the share of an
all-reduce that hides behind products and the share of their rate products lose while one runs beside them
(`overlap_slowdown`), and where the processes outnumber the cores what a message waits for its rank to get a core
(`wake_us`), and on CPU processes the CPU a message costs its sender and receiver between computations
(`message_cpu_us`); on rank 0 alone, the disk's write and read bandwidth (a scratch file in the cache directory,
removed afterwards, skipped when the disk lacks room).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from behemoth.comm import all_reduce, barrier
from behemoth.offload.calibrate import measure_disk
from behemoth.planner.cluster import COLLECTIVES, AdamWRate, ClusterSpec, DeviceSpec, HostSpec, LinkSpec
from behemoth.planner.pingpong import collective_curve, core_count, fit_link, group_collectives, message_cpu, sync, timed, wake_latency

MATMUL_SIZES = {"quick": (128, 256, 512, 1024), "full": (128, 256, 512, 1024, 2048, 4096)}
MESSAGE_BYTES = {"quick": (2**12, 2**16, 2**20, 2**23), "full": (2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26)}
DISK_BYTES = {"quick": 64 * 2**20, "full": 512 * 2**20}
CPU_BF16_LIMIT = 512  # bf16 products on a CPU without native bf16 run ~100x slower: measured only up to this size


def matmul_curve(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...], group: dist.ProcessGroup) -> list[tuple[int, float]]:
    """(n, TFLOP/s) of n x n x n products, every rank multiplying at once, by the library training multiplies with
    (`models.gemm`: oneDNN for CPU float32 where train.gemm=auto finds it faster than torch's BLAS, as on this
    project's AMD CPU, where it runs at about twice MKL's rate)."""
    from behemoth.models.gemm import mm

    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for n in sizes:
        a = torch.randn(n, n, device=device, generator=g).to(dtype)
        b = torch.randn(n, n, device=device, generator=g).to(dtype)
        reps = max(2, min(20, int(2e9 / (2 * n**3)) + 1))
        seconds = timed(lambda: mm(a, b), reps, device, group)
        out.append((n, 2 * n**3 / seconds / 1e12))
    return out


def memory_bandwidth(device: torch.device, group: dist.ProcessGroup, nbytes: int = 2**27) -> float:
    """GB/s of a large copy (read + write), every rank copying at once."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), 5, device, group)
    return 2 * nbytes / seconds / 1e9


def op_overhead(device: torch.device) -> float:
    """Microseconds of one operator of a model's pass when its tensors are tiny: a tiny GPT block's forward and backward
    (launch, dispatch, autograd and module overhead) divided by the operators the cost model counts for it."""
    from behemoth.models.gpt import Block, GPTConfig
    from behemoth.planner.compute import FORWARD_OPS_PER_BLOCK

    g = torch.Generator(device=device).manual_seed(0)
    block = Block(GPTConfig(n_layer=1, n_head=2, d_model=16, context=8, vocab_size=8)).to(device)
    x = torch.randn(1, 8, 16, device=device, generator=g, requires_grad=True)
    seconds = timed(lambda: block(x).sum().backward(), 20, device)
    return seconds / (3 * FORWARD_OPS_PER_BLOCK) * 1e6


ADAMW_ELEMENTS = (2**16, 2**20)  # the two sizes the AdamW rate is fitted to (16 tensors each, a small model's shape)


def adamw_step_seconds(device: torch.device, elements: int, group: dist.ProcessGroup | None = None, tensors: int = 16) -> float:
    """Median seconds of one AdamW step (the kernel training picks for the device, weight decay on) over `elements`
    float32 parameter elements in `tensors` tensors, every rank stepping at once."""
    from behemoth.config import TrainConfig
    from behemoth.parallel.sync import adamw_kernel

    kernel = adamw_kernel(TrainConfig(), device)
    params = [torch.nn.Parameter(torch.randn(elements // tensors, device=device)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=kernel == "foreach", fused=kernel == "fused")
    return timed(opt.step, 5, device, group)


def adamw_rate(device: torch.device, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """AdamW's fixed microseconds and nanoseconds per element, fitted through two step sizes (`ADAMW_ELEMENTS`)."""
    small, large = ADAMW_ELEMENTS
    t_small, t_large = (adamw_step_seconds(device, n, group) for n in ADAMW_ELEMENTS)
    per_element = max(t_large - t_small, 0.05 * t_large) / (large - small)
    return {"fixed_us": max(0.0, t_small - per_element * small) * 1e6, "ns_per_element": per_element * 1e9}


def comm_overlap(device: torch.device, group: dist.ProcessGroup, nbytes: int = 2**23, n: int = 512, rounds: int = 7) -> float:
    """The share of an all-reduce that hides behind matrix products running at the same time: (compute alone +
    all-reduce alone - both together) / the shorter of the two, clamped to [0, 1]; the median of `rounds` rounds, each
    timing the three in turn (on a shared CPU host one round alone spread from 0 to 0.92 here)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=g)
    buf = torch.ones(nbytes // 4, device=device)
    reduce = lambda: all_reduce(buf, group)  # noqa: E731
    reps = max(1, int(timed(reduce, 3, device, group) / max(timed(lambda: a @ a, 3, device, group), 1e-6)))

    def both() -> None:
        pending = all_reduce(buf, group, async_op=True)
        for _ in range(reps):
            a @ a
        pending.wait()

    shares = []
    for _ in range(rounds):
        alone, compute = timed(reduce, 3, device, group), timed(lambda: [a @ a for _ in range(reps)], 3, device, group)
        together = timed(both, 3, device, group)
        shares.append(min(1.0, max(0.0, (alone + compute - together) / min(alone, compute))))
    return statistics.median(shares)


def overlap_slowdown(device: torch.device, group: dist.ProcessGroup, nbytes: int = 2**22, n: int = 256, reps: int = 5) -> float:
    """The share of its rate a matrix-product loop loses while all-reduces run beside it (the cost model's
    `overlap_slowdown`): the loop timed alone and while enough asynchronous all-reduces of `nbytes` to outlast it are in
    flight, in alternation (so that a load that comes and goes touches both alike), 1 - median alone / median beside,
    clamped to [0, 0.9]. Wall seconds on a GPU and on a CPU alike: on CPU processes the collective's transport runs on
    host threads that take the product loop's core, and the loop loses that as time waiting for the core, which its own
    CPU seconds do not show (measured by thread CPU time the loss was 0.01-0.02 here, by wall time 0.33-0.43 on 2 and
    4 processes, and ZeRO-3's passes ran 11-12% longer than ZeRO-0's beside its gathers). Every rank issues the same
    number of all-reduces (the larger rank's count: collectives must match); the ranks' mean."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=g)
    buf = torch.ones(nbytes // 4, device=device)
    one = max(timed(lambda: a @ a, 3, device, group), 1e-6)
    reduce = max(timed(lambda: all_reduce(buf, group), 3, device, group), 1e-6)
    count = max(8, int(5 * reduce / one))  # products in the loop: about five all-reduces long
    first = _loop_seconds(a, count, device, group, [])
    agreed = torch.tensor([float(count), 2 * first / reduce + 2], device=device)
    all_reduce(agreed, group, op=dist.ReduceOp.MAX)
    count, issued = int(agreed[0].item()), int(agreed[1].item())  # all-reduces back to back outlasting the loop
    alone, beside = [], []
    for _ in range(reps):
        alone.append(_loop_seconds(a, count, device, group, []))
        beside.append(_loop_seconds(a, count, device, group, [lambda: all_reduce(buf, group, async_op=True)] * issued))
    mean = torch.tensor([1 - statistics.median(alone) / statistics.median(beside)], device=device)
    all_reduce(mean, group)  # the ranks' mean: every rank reports the same
    return min(0.9, max(0.0, float(mean.item()) / dist.get_world_size(group)))


def _loop_seconds(a: torch.Tensor, count: int, device: torch.device, group: dist.ProcessGroup, collectives: list[Any]) -> float:
    """Seconds of `count` products a @ a, with `collectives` (each issuing an asynchronous collective) started before it
    and waited for after it (every rank starts together)."""
    barrier(group)
    pending = [issue() for issue in collectives]
    sync(device)
    t0 = time.perf_counter()
    for _ in range(count):
        a @ a
    sync(device)
    seconds = time.perf_counter() - t0
    for p in pending:
        p.wait()
    return seconds


def block_efficiency(
    device: torch.device,
    group: dist.ProcessGroup,
    matmul: list[tuple[int, float]],
    bandwidth: float,
    overhead_us: float,
    flash: float = 0.5,
    d: int = 256,
    tokens: int = 512,
) -> float:
    """The residual of the cost model on a real block (every rank at once): the seconds steptime prices for a GPT
    block's products and attention, over its measured time less what it prices apart (elementwise traffic at the
    memory bandwidth, a launch per operator). 1 when the model explains the block; below when the block is slower."""
    from behemoth.models.gemm import route_linears
    from behemoth.models.gpt import Block, GPTConfig

    cfg = GPTConfig(n_layer=1, n_head=4, d_model=d, context=tokens, vocab_size=8)
    g = torch.Generator(device=device).manual_seed(0)
    block = Block(cfg).to(device)
    route_linears(block)  # its products by the library training's engine and `matmul_curve` use (train.gemm)
    x = torch.randn(1, tokens, d, device=device, generator=g, requires_grad=True)
    seconds = timed(lambda: block(x).sum().backward(), 5, device, group)
    matrices, apart = priced_block(matmul, bandwidth, overhead_us, d, tokens, flash)
    return min(1.0, max(0.05, matrices / max(seconds - apart, 1e-9)))


def priced_block(
    matmul: list[tuple[int, float]], bandwidth: float, overhead_us: float, d: int, tokens: int, flash: float = 0.5
) -> tuple[float, float]:
    """(products and attention, everything else) seconds steptime prices for one block of width `d` over `tokens`,
    forward and backward, on a device with the measured fp32 `matmul` curve."""
    from behemoth.config import load_config
    from behemoth.planner.compute import block_costs
    from behemoth.planner.layout import Layout, Workload

    options = [f"model.d_model={d}", "model.n_head=4", "model.n_layer=1", f"model.context={tokens}", "model.vocab_size=8"]
    work = Workload.of(load_config(None, options + [f"train.seq_len={tokens}", "train.global_batch=1"]))
    lay = Layout(1, 1, 1, 0, False, 1, 1, "1f1b", 1)
    dev = DeviceSpec(
        name="probe",
        memory_gb=1.0,
        peak_tflops={"fp32": max(v for _, v in matmul)},
        matmul_tflops={"fp32": matmul},
        memory_bandwidth_gbs=bandwidth,
        op_overhead_us=overhead_us,
        attention_kernel="materialized",
    )
    spec = ClusterSpec(
        name="probe",
        devices_per_node=1,
        device=dev,
        intra_node=LinkSpec(latency_us=1.0, bandwidth_gbs=1.0),
        host=HostSpec(memory_gb=1.0, memory_bandwidth_gbs=1.0, disk_bandwidth_gbs=1.0),
    )
    whole = block_costs(work, lay, spec)
    bare = block_costs(work, lay, spec.model_copy(update={"device": dev.model_copy(update={"op_overhead_us": 0.0, "memory_bandwidth_gbs": 1e12})}))
    total, matrices = whole.passes - 2 * whole.comm, bare.passes - 2 * bare.comm
    return matrices, total - matrices


def attention_efficiency(
    device: torch.device, group: dist.ProcessGroup | None, peak_tflops: float, heads: int = 4, seq: int = 256, hd: int = 64
) -> float:
    """The share of `peak_tflops` the runtime's attention kernel (causal scaled_dot_product_attention, forward and
    backward) reaches, counted as steptime counts a flash kernel's work: half the square's FLOPs forward, 2.5x that back."""
    import torch.nn.functional as F

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, hd, device=device, generator=g, requires_grad=True) for _ in range(3))
    seconds = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(), 5, device, group)  # type: ignore[no-untyped-call]
    flops = 0.5 * 4.0 * heads * seq * seq * hd * 3.5
    return min(1.0, max(0.01, flops / seconds / (peak_tflops * 1e12)))


def disk_bandwidth(folder: Path, nbytes: int) -> float | None:
    """GB/s of writing (with fsync) and reading back (from the disk, not the page cache) a scratch file: the harmonic mean
    of offload.calibrate's two rates; None when the disk lacks twice that room."""
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(folder).free < 2 * nbytes:
        return None
    read, write = measure_disk(folder, nbytes)
    return 2 / (1 / read + 1 / write) / 1e9


def calibrate_worker(mode: str, cache_dir: str) -> dict[str, Any]:
    """One rank of the calibration (see the module docstring); rank 0 returns the measurements."""
    from behemoth.models.gemm import describe, set_gemm
    from behemoth.topology import init_runtime, keep_freed_host_memory

    rt = init_runtime(timeout_s=300.0)
    set_gemm("auto")  # what a training run multiplies with by default (train.gemm): products and blocks timed so
    keep_freed_host_memory()  # and its host memory as a training run without offload keeps it (train.host_memory=auto)
    try:
        group, device = rt.world_group, rt.device
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
        out: dict[str, Any] = {"world": rt.world_size, "device": device.type, "matmul": {}, "collectives": {}}
        for name, dtype in dtypes.items():
            sizes = MATMUL_SIZES[mode] if device.type == "cuda" or name == "fp32" else tuple(n for n in MATMUL_SIZES[mode] if n <= CPU_BF16_LIMIT)
            out["matmul"][name] = matmul_curve(device, dtype, sizes, group)
        if rt.world_size > 1:
            for op in COLLECTIVES:
                out["collectives"][op] = collective_curve(op, MESSAGE_BYTES[mode], device, group)
            out["group_collectives"] = group_collectives(MESSAGE_BYTES[mode], device, group)
        out["memory_bandwidth_gbs"] = memory_bandwidth(device, group)
        out["comm_overlap"] = comm_overlap(device, group) if rt.world_size > 1 else (0.9 if device.type == "cuda" else 0.0)
        out["overlap_slowdown"] = overlap_slowdown(device, group) if rt.world_size > 1 else 0.0
        out["op_overhead_us"] = op_overhead(device)
        out["wake_us"] = wake_latency(device, group) if rt.world_size > 1 else 0.0
        out["message_cpu_us"] = message_cpu(device, group) if rt.world_size > 1 else 0.0
        out["adamw"] = adamw_rate(device, group)
        out["flash_efficiency"] = attention_efficiency(device, group, max(v for _, v in out["matmul"]["fp32"]))
        out["block_efficiency"] = block_efficiency(
            device, group, out["matmul"]["fp32"], out["memory_bandwidth_gbs"], out["op_overhead_us"], out["flash_efficiency"]
        )
        out["disk_bandwidth_gbs"] = disk_bandwidth(Path(cache_dir), DISK_BYTES[mode]) if rt.is_main else None
        out["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU process ({os.cpu_count()} cores shared)"
        out["gemm"] = describe()
        out["device_memory"] = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        out["cores"] = core_count() if device.type == "cpu" else None
        return out
    finally:
        rt.close()


def host_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def spec_from(m: dict[str, Any], *, name: str = "local") -> ClusterSpec:
    """A `ClusterSpec` of this machine from rank 0's measurements (a CPU process counts as a device with RAM / N)."""
    world = m["world"]
    memory = m["device_memory"] or host_memory_bytes() / world
    ops = {op: fit_link(op, curve, 2 if op == "p2p" else world) for op, curve in m["collectives"].items()}
    groups = {int(n): {op: fit_link(op, curve, int(n)) for op, curve in by_op.items()} for n, by_op in m.get("group_collectives", {}).items()}
    link = LinkSpec(
        latency_us=statistics.median(o[0] for o in ops.values()) if ops else 1.0,
        bandwidth_gbs=statistics.median(o[1] for o in ops.values()) if ops else m["memory_bandwidth_gbs"],
        ops=ops,
        group_ops=groups | {world: {op: v for op, v in ops.items() if op != "p2p"}} if groups else {},
    )
    peak = {dtype: max(v for _, v in curve) for dtype, curve in m["matmul"].items() if curve}
    device = DeviceSpec(
        name=m["device_name"],
        memory_gb=memory / 1e9,
        reserved_gb=0.05 * memory / 1e9,
        peak_tflops=peak,
        matmul_tflops={k: [tuple(p) for p in v] for k, v in m["matmul"].items() if v},
        memory_bandwidth_gbs=m["memory_bandwidth_gbs"],
        op_overhead_us=m["op_overhead_us"],
        adamw=AdamWRate(**m["adamw"]) if m.get("adamw") else None,
        comm_overlap=m.get("comm_overlap", 0.9 if m["device"] == "cuda" else 0.0),
        async_launch=m["device"] == "cuda",  # CUDA queues kernels ahead of the device; a CPU runs each operator as it is called
        overlap_slowdown=m.get("overlap_slowdown", 0.0),
        block_efficiency=m.get("block_efficiency", 1.0),
        attention_kernel="flash",  # the runtime's scaled_dot_product_attention
        flash_efficiency=m.get("flash_efficiency", 0.5),
    )
    host = HostSpec(
        memory_gb=host_memory_bytes() / 1e9,
        memory_bandwidth_gbs=m["memory_bandwidth_gbs"] * (world if m["device"] == "cpu" else 1),
        disk_bandwidth_gbs=m["disk_bandwidth_gbs"] or 0.1,
        cores=m.get("cores"),
        wake_us=m.get("wake_us", 0.0),
        message_cpu_us=m.get("message_cpu_us", 0.0),
    )
    measured = {f"{op}_seconds_by_bytes": [tuple(p) for p in curve] for op, curve in m["collectives"].items()}
    for n, by_op in m.get("group_collectives", {}).items():
        measured.update({f"{op}_seconds_by_bytes_groups_of_{n}": [tuple(p) for p in curve] for op, curve in by_op.items()})
    measured.update({f"matmul_{k}_tflops_by_n": [tuple(p) for p in v] for k, v in m["matmul"].items()})
    return ClusterSpec(
        name=name,
        nodes=1,
        devices_per_node=world,
        device=device,
        intra_node=link,
        host=host,
        kind="calibrated",
        source=f"behemoth calibrate on {world} local {m['device']} process(es), {time.strftime('%Y-%m-%d %H:%M')}"
        + (f"; {m['gemm']}" if m.get("gemm") else ""),
        measured=measured,
    )


def cache_folder(cache_dir: str | None = None) -> Path:
    return Path(cache_dir or os.environ.get("BEHEMOTH_CACHE") or Path.home() / ".cache" / "behemoth").expanduser()


def cached_spec_path(nproc: int, cache_dir: str | None = None) -> Path:
    """Where `behemoth calibrate --nproc N` keeps its result for `behemoth plan --nproc N` and `parallel=auto`."""
    return cache_folder(cache_dir) / f"cluster-local-{nproc}.yaml"


def calibrate(nproc: int, *, mode: str = "quick", cache_dir: str | None = None, timeout_s: float = 600.0) -> ClusterSpec:
    """Measure this machine with `nproc` local processes and describe it."""
    from behemoth.faults.launch import launch

    folder = str(cache_folder(cache_dir))
    if nproc == 1:
        return spec_from(_single_process(mode, folder))
    results = launch(nproc, calibrate_worker, mode, folder, timeout_s=timeout_s)
    return spec_from(results[0])


def _single_process(mode: str, folder: str) -> dict[str, Any]:
    """The calibration in this process (a world of one: no collectives to measure)."""
    os.environ.pop("MASTER_ADDR", None)
    return calibrate_worker(mode, folder)


def probe_spec(nproc: int) -> ClusterSpec:
    """A quick description of this machine for `nproc` processes, measured in this process in about a second: the
    matrix rate (one process's share of the cores: what it measures alone, times cores / nproc where the processes
    outnumber the cores, as `behemoth calibrate` measures every rank at once), the memory bandwidth, an operator's cost
    and AdamW's per element (likewise shared). The links are not
    measured (no processes are started): a single machine's collectives are assumed to run at a tenth of the memory
    bandwidth with 100 us of latency, until `behemoth calibrate` measures them."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    try:
        share = min(1.0, core_count() / nproc) if device.type == "cpu" else 1.0  # nproc ranks on fewer cores: each its share
        curve = [
            (n, share * 2 * n**3 / timed(lambda n=n: torch.ones(n, n, device=device) @ torch.ones(n, n, device=device), 3, device) / 1e12)
            for n in (128, 256, 512)
        ]
        src = torch.ones(2**24, device=device)
        dst = torch.empty_like(src)
        bandwidth = 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), 3, device) / 1e9 / (nproc if device.type == "cpu" else 1)
        overhead = op_overhead(device)
        flash = attention_efficiency(device, None, max(v for _, v in curve))
        adamw = adamw_rate(device)
        adamw = {"fixed_us": adamw["fixed_us"], "ns_per_element": adamw["ns_per_element"] / share}  # nproc ranks stepping at once
    finally:
        torch.set_num_threads(threads)
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else host_memory_bytes() / nproc
    m = {
        "world": nproc,
        "device": device.type,
        "device_memory": memory if device.type == "cuda" else None,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU process ({os.cpu_count()} cores shared)",
        "matmul": {"fp32": curve},
        "collectives": {},
        "memory_bandwidth_gbs": bandwidth,
        "op_overhead_us": overhead,
        "comm_overlap": 0.9 if device.type == "cuda" else (0.0 if nproc >= (os.cpu_count() or 1) else 0.5),
        "disk_bandwidth_gbs": None,
        "cores": core_count() if device.type == "cpu" else None,
        "flash_efficiency": flash,
        "adamw": adamw,
    }
    spec = spec_from(m, name="local (probed)")
    link = LinkSpec(latency_us=100.0, bandwidth_gbs=bandwidth / 10)
    return spec.model_copy(
        update={
            "intra_node": link,
            "kind": "described",
            "source": f"probed in one process for {nproc} processes; links assumed (run behemoth calibrate)",
        }
    )


def local_cluster(nproc: int, cache_dir: str | None = None) -> ClusterSpec:
    """This machine for `nproc` processes: `behemoth calibrate`'s cached measurement if there is one, else a probe."""
    from behemoth.planner.cluster import load_cluster

    path = cached_spec_path(nproc, cache_dir)
    return load_cluster(path) if path.is_file() else probe_spec(nproc)
