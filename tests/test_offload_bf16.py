"""Offload with bf16 parameters (parallel.param_dtype=bf16) is in-memory ZeRO-3's bf16 training, streamed: float32
masters and moments on their tier, units gathered and computed with in bf16, gradients reduced and accumulated in bf16.

Where the two runtimes add the same numbers in the same order (one process, any accumulation; two processes with one
micro-batch each) losses and final weights are bit-equal to in-memory ZeRO-3 with bf16 parameters, for the host and
disk tiers, deferred and fused steps. With two micro-batches on each of two ranks ZeRO-3 reduce-scatters every
micro-batch and offload once per stay (bf16 sums in another order): losses then agree within 1e-4. Every curve
tracks the float32 single-process one within bf16's tolerance, and a checkpoint of a bf16 offloaded run resumes on
the same curve, offloaded or in memory on another layout (the checkpoint holds the float32 masters).
"""

from __future__ import annotations

import pytest
import torch

from tests.common import tiny_config, train_body
from tests.dist import run_ranks

STEPS = "train.steps=4"
BF16 = "parallel.param_dtype=bf16"
DISK = ("offload.params=disk", "offload.optimizer=disk")
HOST = ("offload.params=host", "offload.optimizer=host")
BF16_TOLERANCE = 2e-3  # relative loss difference from float32 at every step, as tests/test_zero.py allows bf16 ZeRO


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs by (world, options), each trained once per module (in memory ZeRO-3 references are shared)."""
    cache: dict[tuple, dict] = {}

    def run(world: int, *options: str) -> dict:
        key = (world, *options)
        if key not in cache:
            cache[key] = run_ranks(world, train_body, tiny_config(tmp_path_factory.mktemp("run"), STEPS, *options))[0]
        return cache[key]

    return run


def assert_bit_equal(ref: dict, got: dict) -> None:
    assert got["losses"] == ref["losses"], (got["losses"], ref["losses"])
    assert ref["weights"].keys() == got["weights"].keys()
    for name, a in ref["weights"].items():
        assert a.dtype == got["weights"][name].dtype == torch.float32, f"{name}: the checkpoint holds float32 masters"
        assert torch.equal(a, got["weights"][name]), f"{name}: max |diff| {(a - got['weights'][name]).abs().max().item():.3g}"


@pytest.mark.parametrize(
    "world, micro, tiers, clip",
    [
        (1, "train.micro_batch=4", DISK, ()),  # two micro-batches, deferred step with clipping
        (1, "train.micro_batch=4", HOST, ("train.grad_clip=0",)),  # fused step during backward
        (2, "train.micro_batch=4", DISK, ()),  # one micro-batch per rank: bf16 reduce-scatter of the same sums
    ],
)
def test_bf16_offload_is_in_memory_zero3_bit_for_bit(world, micro, tiers, clip, runs):
    ref = runs(world, micro, *clip, "parallel.zero_stage=3", BF16)
    got = runs(world, micro, *clip, *tiers, BF16)
    assert_bit_equal(ref, got)
    fp32 = runs(1, "train.micro_batch=4", *clip)
    gaps = [abs(a - b) / a for a, b in zip(fp32["losses"], got["losses"])]
    assert max(gaps) < BF16_TOLERANCE, gaps
    assert max(gaps) > 0, "bf16 compute must differ from float32 somewhere (or the run did not compute in bf16)"


def test_bf16_offload_with_accumulation_on_two_ranks_follows_zero3(runs):
    """Two micro-batches on each rank: the same gradients summed in another order, so close, not equal."""
    ref = runs(2, "train.micro_batch=2", "parallel.zero_stage=3", BF16)
    got = runs(2, "train.micro_batch=2", *HOST, BF16)
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"]), 1):
        assert abs(a - b) <= 1e-4 * a, f"step {step}: loss {b} vs ZeRO-3 bf16 {a}"
    fp32 = runs(1, "train.micro_batch=4")
    assert max(abs(a - b) / a for a, b in zip(fp32["losses"], got["losses"])) < BF16_TOLERANCE


def test_a_bf16_offloaded_checkpoint_resumes_on_the_curve(runs, tmp_path):
    """Saved at step 2 of a bf16 disk-offloaded run, resumed offloaded (bit-equal to the uninterrupted run) and in
    memory under ZeRO-3 with bf16 parameters on two ranks (the same curve within ZeRO-3's own accumulation order)."""
    options = ("train.micro_batch=4", "checkpoint.every=2", BF16)
    full = run_ranks(1, train_body, tiny_config(tmp_path / "full", STEPS, *options, *DISK))[0]
    assert full["losses"] == runs(1, "train.micro_batch=4", *DISK, BF16)["losses"], "checkpoints do not change the run"
    ckpt = str(tmp_path / "full" / "checkpoints/step_0000002")
    again = run_ranks(1, train_body, tiny_config(tmp_path / "again", STEPS, *options, *DISK), ckpt)[0]
    assert again["start"] == 2
    assert_bit_equal({"losses": full["losses"][2:], "weights": full["weights"]}, again)
    moved = run_ranks(2, train_body, tiny_config(tmp_path / "zero3", STEPS, *options, "parallel.zero_stage=3"), ckpt)[0]
    assert moved["start"] == 2
    for a, b in zip(full["losses"][2:], moved["losses"]):
        assert abs(a - b) <= 1e-4 * a, (full["losses"][2:], moved["losses"])
