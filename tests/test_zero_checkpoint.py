"""ZeRO checkpoints stay sharded (DCP chunks keyed by single-process names) and load under another
stage and another number of ranks, continuing the same curve; export consolidates them."""

from __future__ import annotations

import math
import random
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from behemoth.faults.checkpoint import resolve_checkpoint
from behemoth.models.gpt import build_gpt
from behemoth.parallel.chunked import flat_range_boxes
from behemoth.parallel.zero.layout import FlatLayout
from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks

CKPT6 = "checkpoints/step_0000006"
ACCUMULATE = {1: "train.micro_batch=4", 2: "train.micro_batch=2", 4: "train.micro_batch=1"}


def _config(run_dir, world, stage):
    return tiny_config(run_dir, ACCUMULATE[world], f"parallel.zero_stage={stage}", "checkpoint.every=6", "checkpoint.keep=3")


@pytest.fixture(scope="module")
def stage3_on_4(tmp_path_factory):
    """12 steps at ZeRO stage 3 on 4 processes, checkpointing every 6."""
    run_dir = tmp_path_factory.mktemp("z3")
    return run_dir, run_ranks(4, train_body, _config(run_dir, 4, 3))[0]


@pytest.mark.parametrize("world, stage", [(2, 1), (1, 0)])
def test_stage3_checkpoint_resumes_under_another_stage_and_size(stage3_on_4, tmp_path, world, stage):
    run_dir, full = stage3_on_4
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    resumed = run_ranks(world, train_body, _config(copy, world, stage), str(copy / CKPT6))[0]
    assert resumed["start"] == 6 and len(resumed["losses"]) == 6
    assert_close_runs({"losses": full["losses"][6:], "weights": full["weights"]}, resumed)


def test_replicated_checkpoint_resumes_at_stage3(tmp_path):
    """The other direction: a data-parallel (stage 0) checkpoint from 2 ranks continues at stage 3 on 4."""
    full = run_ranks(2, train_body, _config(tmp_path / "dp", 2, 0))[0]
    resumed = run_ranks(4, train_body, _config(tmp_path / "dp", 4, 3), str(tmp_path / "dp" / CKPT6))[0]
    assert_close_runs({"losses": full["losses"][6:], "weights": full["weights"]}, resumed)


def test_checkpoint_is_sharded_under_single_process_names(stage3_on_4, tmp_path):
    run_dir, full = stage3_on_4
    ckpt = resolve_checkpoint(run_dir)
    metadata = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    names = set(build_gpt(_gpt_config(run_dir)).state_dict())
    assert {k.split(".", 1)[1] for k in metadata if k.startswith("model.")} == names
    assert {k.split(".", 1)[1].rsplit(".", 1)[0] for k in metadata if k.startswith("optim.")} == names
    big = metadata["model.blocks.0.mlp.fc.weight"]
    assert tuple(big.size) == (128, 32) and len(big.chunks) >= 2, "a large weight is stored as chunks from several ranks"
    assert len(list(ckpt.glob("*.distcp"))) == 4, "every rank wrote its own shard"
    from safetensors.torch import load_file

    from behemoth.cli import main

    assert main(["export", str(ckpt), "--out", str(tmp_path / "w.safetensors")]) == 0
    exported = load_file(str(tmp_path / "w.safetensors"))
    assert exported.keys() == full["weights"].keys()
    assert all(torch.equal(exported[k], full["weights"][k]) for k in exported)


def _gpt_config(run_dir):
    from behemoth.models.gpt import GPTConfig

    return GPTConfig.model_validate(tiny_config(run_dir)["model"])


def test_flat_layout_pieces_tile_every_parameter():
    """Each parameter's elements are held by exactly one rank, in order; shards are equal; padding < N."""
    shapes = [(5, 7), (3,), (2, 3, 4), (1,), (64, 9)]
    for world in (1, 2, 3, 4, 7):
        layout = FlatLayout([f"p{i}" for i in range(len(shapes))], shapes, world)
        assert layout.padded % world == 0 and layout.padding < world
        held = {i: [] for i in range(len(shapes))}
        for rank in range(world):
            for piece in layout.pieces(rank):
                assert 0 <= piece.shard_offset and piece.shard_offset + piece.numel <= layout.shard_size
                held[piece.index].append((piece.start, piece.stop))
        for i, ranges in held.items():
            assert [a for a, _ in ranges][0] == 0 and ranges[-1][1] == math.prod(shapes[i])
            assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:])), f"param {i} pieces not contiguous: {ranges}"


def test_flat_range_boxes_cover_exactly_the_range():
    rng = random.Random(0)
    for _ in range(200):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
        n = math.prod(shape)
        start = rng.randint(0, n)
        stop = rng.randint(start, n)
        mark = torch.zeros(shape, dtype=torch.int64)
        flat_order = []
        for offsets, sizes in flat_range_boxes(start, stop, shape):
            region = mark[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            region += 1
            flat_order.extend(torch.arange(n).view(shape)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].flatten().tolist())
        expected = torch.zeros(n, dtype=torch.int64)
        expected[start:stop] = 1
        assert torch.equal(mark.flatten(), expected), (shape, start, stop)
        assert flat_order == list(range(start, stop)), "boxes follow the flat order, so each is a contiguous slice of the shard"
