"""The offload layer's parts, each against a reference: tiers, background I/O, orders and their swap volumes,
AdamW on a shard (float32 against torch's AdamW, 8-bit against its quantization bound), the memory model,
the scratch directory's claims, and the refusals before launch."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from behemoth.offload.budget import ActivationShape, UnitSize, fit_prefetch, peak_bytes
from behemoth.offload.io import IOPool
from behemoth.offload.order import StateSizes, harmony_order, naive_order, plan_residencies, swap_bytes
from behemoth.parallel.sync import AdamWSettings
from behemoth.parallel.zero.adam import BLOCK, AdamFP32, ShardPiece, block_offsets, state_bytes
from behemoth.parallel.zero.tiers import make_tier

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["none", "cpu", "disk"])
def test_tier_round_trip_and_counted_bytes(name, tmp_path):
    """What is stored comes back; the disk tier counts its bytes, the others move none on a CPU-only machine."""
    tier = make_tier(name, CPU, root=tmp_path / "t")
    tier.allocate("a", 1000, torch.float32)
    assert torch.equal(tier.fetch("a"), torch.zeros(1000)), "a fresh key reads as zeros"
    x = torch.randn(1000)
    tier.store("a", x)
    assert torch.equal(tier.fetch("a"), x)
    assert torch.equal(tier.view("a"), x), "the checkpoint view sees what was stored"
    moved = 2 * 4000 if name == "disk" else 0
    assert (tier.read_bytes, tier.written_bytes) == (moved, 4000 if name == "disk" else 0)
    if name == "disk":
        tier.view("a")[:10] = 7.0  # a checkpoint load writes through the memory map
        assert torch.equal(tier.fetch("a")[:10], torch.full((10,), 7.0))
        tier.close()
        assert not list((tmp_path / "t").glob("*.bin")), "closing the tier removes its files"


def test_io_pool_keeps_a_units_jobs_in_order_and_surfaces_errors():
    pool = IOPool(threads=3, max_in_flight=8)
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def job(unit: int, k: int) -> None:
        time.sleep(0.002 * (3 - k))  # later jobs are quicker: only the ordering keeps them in order
        with lock:
            seen.append((unit, k))

    for k in range(3):
        for unit in range(2):
            pool.submit(unit, job, unit, k)
    pool.drain()
    for unit in range(2):
        assert [k for u, k in seen if u == unit] == [0, 1, 2]
    pool.submit(0, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        pool.drain()
    pool.close()


def _sizes(n_units: int) -> list[StateSizes]:
    return [StateSizes(100 + u, 100 + u, 200 + 2 * u) for u in range(n_units)]


@pytest.mark.parametrize("deferred", [False, True])
def test_harmony_swap_volume_is_constant_in_microbatches_and_naive_grows_linearly(deferred):
    blocks = 3
    sizes = _sizes(blocks + 2)

    def total(order, m):
        moved = swap_bytes(plan_residencies(order(blocks, m), {}), sizes, deferred=deferred)
        return sum(r + w for r, w in moved.values())

    harmony = [total(harmony_order, m) for m in (1, 2, 4, 16)]
    naive = [total(naive_order, m) for m in (1, 2, 4, 16)]
    assert len(set(harmony)) == 1
    assert naive[0] == harmony[0], "with one micro-batch both orders move the same bytes"
    per_mb = naive[1] - naive[0]
    assert per_mb > 0 and [naive[i] - naive[0] for i in range(4)] == [0, per_mb, 3 * per_mb, 15 * per_mb]
    # naive reads every unit twice per micro-batch (the head once; the embedding stays resident from one micro-batch's
    # backward to the next one's forward), harmony twice per step
    p, head, embedding = sum(s.params for s in sizes), sizes[-1].params, sizes[0].params
    reads = swap_bytes(plan_residencies(naive_order(blocks, 4), {}), sizes, deferred=False)["params"][0]
    assert reads == 4 * (2 * p - head) - 3 * embedding


def test_tied_head_keeps_the_embedding_gradient_on_the_gradient_tier_until_the_embedding_is_done():
    plan = plan_residencies(harmony_order(2, 2), {3: (0,)})
    stays = [s for s in plan.stays if s.unit == 0]
    assert [(s.grads, s.completes, s.partial_in) for s in stays] == [(False, False, False), (True, False, False), (True, True, True)]


def _torch_adamw_reference(p, g, decay_mask, settings, lr, coef, steps):
    ref_p = [torch.nn.Parameter(p[m].clone()) for m in decay_mask]
    opt = torch.optim.AdamW(
        [{"params": [ref_p[0]], "weight_decay": settings.weight_decay}, {"params": [ref_p[1]], "weight_decay": 0.0}],
        lr=lr,
        betas=settings.betas,
        foreach=True,
    )
    for _ in range(steps):
        for rp, m in zip(ref_p, decay_mask):
            rp.grad = g[m].clone()
        torch._foreach_mul_([rp.grad for rp in ref_p], coef)
        opt.step()
    return ref_p


def test_adam_fp32_on_a_shard_is_torchs_adamw():
    """Decay on the matrix piece only, a clipping coefficient, three steps: equal to torch.optim.AdamW element for element."""
    settings = AdamWSettings(1e-2, (0.9, 0.95), 0.1)
    g = torch.Generator().manual_seed(0)
    p, grad = torch.randn(70, generator=g), torch.randn(70, generator=g)
    pieces = [ShardPiece(0, 48, True), ShardPiece(48, 20, False)]  # 2 elements of padding at the end
    adam = AdamFP32(settings)
    state = {"m": torch.zeros(70), "v": torch.zeros(70)}
    mine = p.clone()
    for step in range(1, 4):
        adam.step(mine, grad.clone(), state, pieces, lr=1e-2, coef=0.5, step=step)
    ref = _torch_adamw_reference(p, grad, [slice(0, 48), slice(48, 68)], settings, 1e-2, 0.5, 3)
    assert torch.equal(mine[:48], ref[0].detach()) and torch.equal(mine[48:68], ref[1].detach())
    assert torch.equal(mine[68:], p[68:]), "padding is never stepped"


def test_8bit_quantization_round_trip_is_within_half_a_code_step_of_each_block():
    """Blockwise dynamic quantization: each element comes back within half the largest gap of the code map, times
    its block's absolute maximum (the bound of Dettmers et al.'s scheme)."""
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    code = bnb_f.create_dynamic_map(signed=True)
    gap = float((code[1:] - code[:-1]).max())
    x = torch.randn(10 * BLOCK + 17, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 1, 10 * BLOCK + 17)
    q, qs = bnb_f.quantize_blockwise(x, code=code, blocksize=BLOCK)
    back = bnb_f.dequantize_blockwise(q, absmax=qs.absmax, code=code, blocksize=BLOCK)
    per_block = torch.repeat_interleave(qs.absmax, BLOCK)[: x.numel()]
    err = (back - x).abs()
    assert q.dtype == torch.uint8 and bool((err <= per_block * gap / 2 * 1.001 + 1e-12).all())
    assert float(err.max()) > 0, "8 bits cannot be exact: the bound is the one being tested"


def test_8bit_state_is_laid_out_per_parameter_in_whole_blocks():
    pytest.importorskip("bitsandbytes")
    pieces = [ShardPiece(0, 300, True), ShardPiece(300, 5, False)]
    assert block_offsets(pieces) == [0, 2 * BLOCK, 3 * BLOCK]
    assert state_bytes(pieces, 305, 8) == 2 * 3 * BLOCK + 2 * 4 * 3 and state_bytes(pieces, 305, 32) == 8 * 305


def test_memory_model_fits_the_prefetch_to_the_budget_or_refuses():
    units = [UnitSize(full=1_000_000, shard=1_000_000, state_bytes=8_000_000)] * 6
    act = ActivationShape(1, 64, 128, 512, 256, 4, 2)
    deep = peak_bytes(units, act, prefetch=4, in_flight=7, sharded=False).total
    fit = fit_prefetch(units, act, deep - 1, prefetch=4, io_threads=2, sharded=False)
    assert fit is not None and (fit[0], fit[1]) < (4, 7) and fit[2].total <= deep - 1
    least = peak_bytes(units, act, prefetch=0, in_flight=1, sharded=False).total
    assert fit_prefetch(units, act, least - 1, prefetch=4, io_threads=2, sharded=False) is None


def test_scratch_directory_claims(tmp_path):
    """Free -> claimed; another live process's -> refused; another run's stale one -> refused naming it; this run's
    stale one -> emptied and reported; a folder of other files -> refused."""
    from behemoth.errors import BehemothError
    from behemoth.offload import scratch

    root, run = tmp_path / "s", str(tmp_path / "run")
    assert scratch.claim(root, run) is None and scratch.read_marker(root)["pid"] == os.getpid()
    with pytest.raises(BehemothError, match="in use by run"):
        scratch.claim(root, str(tmp_path / "other"))
    dead = {**scratch.read_marker(root), "pid": _dead_pid()}
    (root / scratch.MARKER).write_text(json.dumps(dead))
    (root / "p.0.bin").write_bytes(b"old")
    with pytest.raises(BehemothError, match="stale scratch of another run"):
        scratch.claim(root, str(tmp_path / "other"))
    note = scratch.claim(root, run)
    assert "removed the stale scratch" in note and not (root / "p.0.bin").exists()
    foreign = tmp_path / "f"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(BehemothError, match="not behemoth scratch"):
        scratch.claim(foreign, run)


def _dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _cfg(*overrides):
    from behemoth.config import load_config

    return load_config(None, ["model=gpt-tiny", "train.global_batch=4", "train.seq_len=32", *overrides])


@pytest.mark.parametrize(
    "overrides, option, words",
    [
        (["offload.params=disk", "parallel.pp=2", "parallel.schedule=chimera", "train.micro_batch=1"], "parallel.pp", "two replicas of every stage"),
        (["offload.params=disk", "parallel.zero_stage=2"], "parallel.zero_stage", "ZeRO-3's shards"),
        (["offload.optimizer=disk", "offload.step=fused"], "offload.step", "before the global norm is known"),
        (["offload.max_memory_gb=1"], "offload.max_memory_gb", "no state is offloaded"),
        (["offload.params=disk", "offload.max_memory_gb=0.0001"], "offload.max_memory_gb", "smaller than one unit plus activations"),
    ],
)
def test_refused_before_launch_in_one_line(overrides, option, words):
    from behemoth.planner.feasibility import problems

    found = [p for p in problems(_cfg(*overrides), 2) if p.option == option]
    assert len(found) == 1 and words in found[0].message and "\n" not in found[0].message


def test_bad_tier_name_is_one_line():
    from behemoth.errors import BehemothError

    with pytest.raises(BehemothError) as err:
        _cfg("offload.params=ssd")
    assert "offload.params='ssd'" in str(err.value) and "'none', 'cpu' or 'disk'" in str(err.value)


def test_launch_refuses_an_unwritable_directory_and_a_disk_too_small(tmp_path):
    from behemoth.planner.offload import offload_launch_problems

    for where in ("/proc/behemoth-scratch", str(tmp_path / "a-file" / "x")):  # no file can be created there, even by root
        (tmp_path / "a-file").write_text("")
        found = offload_launch_problems(_cfg("offload.params=disk", f"offload.dir={where}"), 1)
        assert len(found) == 1 and "cannot be written" in found[0].message, found
    huge = _cfg(
        "offload.params=disk", "offload.optimizer=disk", f"offload.dir={tmp_path / 's'}", "model.n_layer=64", "model.d_model=65536", "model.n_head=64"
    )
    found = offload_launch_problems(huge, 2)
    assert len(found) == 1 and "GiB of disk for 2 rank(s) but its disk has" in found[0].message


def test_estimate_prints_the_plan_and_refuses_a_disk_too_small(tmp_path, capsys):
    from behemoth.cli import main

    args = [
        "estimate",
        "--nproc",
        "1",
        "--no-calibrate",
        "model=gpt-tiny",
        "train.global_batch=2",
        "offload.params=disk",
        "offload.optimizer=disk",
        f"offload.dir={tmp_path / 's'}",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    for words in ("where each state lives", "params     disk", "needed under offload.dir", "memory peak per rank", "harmony  m=1"):
        assert words in out
    assert main(args + ["model.n_layer=64", "model.d_model=65536", "model.n_head=64"]) == 2
    assert "but its disk has" in capsys.readouterr().err


def test_chunked_steps_change_no_value():
    """Stepping in chunks (bounded temporaries) gives exactly the unchunked step, float32 and 8-bit."""
    from behemoth.parallel.zero import adam as adam_module

    settings = AdamWSettings(1e-2, (0.9, 0.95), 0.1)
    pieces = [ShardPiece(0, 3 * BLOCK + 40, True), ShardPiece(3 * BLOCK + 40, 100, False), ShardPiece(3 * BLOCK + 140, 2 * BLOCK, True)]
    n = 5 * BLOCK + 140
    g = torch.Generator().manual_seed(3)
    p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    makers = [lambda: AdamFP32(settings)]
    if __import__("importlib").util.find_spec("bitsandbytes"):
        makers.append(lambda: adam_module.Adam8bit(settings, CPU))
    for make in makers:
        results = []
        for chunk in (adam_module.CHUNK, BLOCK):
            adam_module.CHUNK = chunk
            try:
                a = make()
                spec = a.state_spec(pieces, n)
                state = {k: torch.zeros(numel, dtype=dtype) for k, (numel, dtype) in spec.items()}
                mine = p.clone()
                for step in (1, 2):
                    a.step(mine, grad.clone(), state, pieces, lr=1e-2, coef=0.7, step=step)
                results.append(mine)
            finally:
                adam_module.CHUNK = 2**22
        assert torch.equal(results[0], results[1])
