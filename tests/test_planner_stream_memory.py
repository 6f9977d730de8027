"""A streamed pipeline's predicted peak against the measured one, per rank, within 5% (planner/stream_memory.py); for a
first stage, whose deferred optimizer steps run on two I/O threads that may or may not overlap (its measured peak moved
8-15% from run to run), within 5% of the band between one step at a time and both at once, the planner's price
(tests/test_planner_memory.mismatches).

Each stage streams its own units from disk (on this CPU-only machine the host tier is the stored tensor itself, where a
GPU's fetch copies it to the device as a disk fetch does here), and the measured peak counts every allocation, the I/O
threads' too (`profiler/measure.LiveBytes`). The first stage's peak is the step's first fetches, each applying its
deferred optimizer step (a block's parameters, gradient and both moments, on two threads at once); a later stage's is
a backward's end (the resident and the prefetched unit with their parameters and waiting gradients, the flat gradient
and the weight gradients before the cat that makes it). The closed form before these moments were counted was 14-40%
under the measured peaks. Left out: interleaved, whose first stage's first-pass peak moved from 7.8 to 8.4 MB over
three runs (how far its two deferred steps overlap the block computing beside them), against 8.3 predicted."""

from __future__ import annotations

import pytest

from tests.test_planner_memory import mismatches

DISK = tuple(f"offload.{k}=disk" for k in ("params", "grads", "optimizer"))
GRID = {
    2: [("parallel.pp=2", "parallel.schedule=zb-h1", "train.micro_batch=2", *DISK)],
}
SLOW_GRID = {
    2: [
        ("parallel.pp=2", "parallel.schedule=1f1b", "train.micro_batch=2", *DISK),
        ("parallel.pp=2", "parallel.schedule=1f1b", "train.micro_batch=2", "model.n_layer=8", *DISK),
    ],
    4: [
        ("parallel.pp=2", "parallel.schedule=zb-h1", "train.micro_batch=1", *DISK),  # x dp=2: shards of half a unit
        ("parallel.pp=4", "parallel.schedule=1f1b", "train.micro_batch=1", *DISK),  # one block a stage: one stay a step
        ("parallel.pp=4", "parallel.schedule=zb-h1", "train.micro_batch=1", "model.n_layer=8", *DISK),
    ],
}


@pytest.mark.parametrize("world", sorted(GRID))
def test_a_streamed_pipelines_predicted_peak_matches_measured(world, tmp_path):
    assert mismatches(world, GRID[world], tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(SLOW_GRID))
def test_a_streamed_pipelines_predicted_peak_matches_measured_wider_grid(world, tmp_path):
    assert mismatches(world, SLOW_GRID[world], tmp_path) == []
