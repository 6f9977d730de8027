"""Decode lanes (decode_lanes.py): decode steps that attend to dense per-request lanes give the tokens of the gather
path exactly, through requests finishing at different steps, newcomers, preemption and a byte limit that turns lanes
off; a lane is filled once per request and extended by the steps after."""

from __future__ import annotations

import pytest
import torch

from behemoth.inference import SamplingParams, load
from behemoth.inference.decode_lanes import DecodeLanes
from behemoth.inference.generate import CachePolicy
from behemoth.inference.scheduler import SchedulerPolicy
from tests.test_serve_speculative import save_llama

PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57], [7] * 11, [60, 2]]
MAX_TOKENS = [14, 6, 20, 9, 17]  # requests finish at different steps: rows leave the batch, lanes go back


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_llama(str(tmp_path_factory.mktemp("llama")), [], 5)


BLOCKS_OF_4 = CachePolicy(block_size=4)


def run(folder: str, lanes: bool, cache: CachePolicy = BLOCKS_OF_4, max_batch: int = 8, limit: int | None = None):
    gen = load(folder, cache=cache)
    decoder = gen.runner.fused_decoder()
    assert decoder is not None
    decoder.use_lanes = lanes
    sched = gen.scheduler(SchedulerPolicy(max_batch=max_batch, context=gen.context))
    if limit is not None:  # lanes of at most `limit` bytes
        layout = gen.runner.storage.layout
        decoder.lanes = DecodeLanes(list(gen.runner.layers), layout.kv_heads, layout.head_dim, limit, torch.float32, torch.device("cpu"))
    requests = []
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        requests.append(sched.submit(prompt, gen.with_eos(SamplingParams(max_tokens=n), True)))
        if i == 2:  # later requests arrive while the first ones decode
            for _ in range(3):
                sched.step()
    sched.run_until_done()
    return [r.output for r in requests], sched.stats, decoder.lanes


def test_lanes_give_the_gather_paths_tokens(folder):
    plain, _, none = run(folder, lanes=False)
    laned, stats, lanes = run(folder, lanes=True)
    assert none is None and lanes is not None
    assert laned == plain and [len(t) for t in laned] == MAX_TOKENS
    assert lanes.fills <= len(PROMPTS) + 2  # each request's lane filled about once (again only after a step it sat out)
    assert lanes.count >= 3 and lanes.capacity >= max(len(p) + n for p, n in zip(PROMPTS, MAX_TOKENS))


def test_preempted_requests_come_back_in_a_new_lane_with_the_same_tokens(folder):
    small = CachePolicy(block_size=4, max_blocks=14)  # too few blocks for every request: the latest ones are preempted
    plain, stats, _ = run(folder, lanes=False, cache=small)
    laned, laned_stats, lanes = run(folder, lanes=True, cache=small)
    assert stats["preemptions"] > 0 and laned_stats["preemptions"] == stats["preemptions"]
    assert laned == plain


def test_lanes_over_their_byte_limit_fall_back_to_the_gather(folder):
    plain, _, _ = run(folder, lanes=False)
    laned, _, lanes = run(folder, lanes=True, limit=1)
    assert laned == plain and lanes.count == 0 and lanes.fills == 0


def test_a_lane_is_kept_while_its_request_decodes_and_given_back_after():
    """The plan on its own: a kept lane needs its request's every earlier position; a request absent from a step loses
    its lane; a new epoch (a preempted request back) gets a new fill."""
    layers, slots = [0], 64
    storage = type("S", (), {})()
    storage.keys = {0: torch.arange(slots * 2 * 3, dtype=torch.float32).view(slots, 2, 3)}
    storage.values = {0: -storage.keys[0]}
    lanes = DecodeLanes(layers, 2, 3, 1 << 20, torch.float32, torch.device("cpu"))
    gather = torch.tensor([[10, 11, 12, 0], [20, 21, 22, 23]])
    step = lanes.plan([("a", 0), ("b", 0)], gather, torch.tensor([2, 3]), storage)
    assert step is not None and step.lane.tolist() == [0, 1] and step.in_order and lanes.fills == 2
    assert torch.equal(lanes.keys[0][1, :3], storage.keys[0][torch.tensor([20, 21, 22])])
    assert step.mask[0, 0, 0].tolist() == [True, True, True, False] and step.mask[1, 0, 0].tolist() == [True] * 4
    step = lanes.plan([("b", 0), ("a", 0)], gather.flip(0), torch.tensor([4, 3]), storage)  # both one token on, reordered
    assert step is not None and step.lane.tolist() == [1, 0] and not step.in_order and lanes.fills == 2
    step = lanes.plan([("a", 0)], gather[:1], torch.tensor([4]), storage)  # b left: its lane goes back
    assert step is not None and lanes.owner[1] is None and lanes.fills == 2
    step = lanes.plan([("a", 1)], gather[:1], torch.tensor([3]), storage)  # a preempted and back: a new fill
    assert step is not None and lanes.fills == 3
    assert lanes.plan([("a", 1), ("a", 1)], gather, torch.tensor([1, 1]), storage) is None  # one owner twice: no lanes
