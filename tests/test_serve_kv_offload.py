"""KV offload: a preempted request's keys and values go to host memory and come back when it is admitted again, instead of
being recomputed; every token (greedy and seeded sampling, chunked prefill or not) equals the recomputing run's."""

from __future__ import annotations

import pytest
import torch

from behemoth.inference import SamplingParams
from behemoth.inference.kv_cache import BlockAllocator
from behemoth.inference.scheduler import Scheduler, SchedulerPolicy
from tests.test_serve_chunked import prompt


class OverwritingAllocator(BlockAllocator):
    """Blocks whose keys and values are overwritten (NaN) as soon as they are freed, as another request reusing them would:
    a preempted request whose cache did not really come back would then read garbage."""

    def __init__(self, num_blocks: int, block_size: int, storage) -> None:
        super().__init__(num_blocks, block_size)
        self.storage = storage

    def release(self, seq) -> int:
        table = list(self.tables.get(seq, []))
        count = super().release(seq)
        if table:
            slots = (torch.tensor(table).unsqueeze(1) * self.block_size + torch.arange(self.block_size)).flatten()
            for layer in self.storage.layout.layers:
                self.storage.keys[layer][slots] = float("nan")
                self.storage.values[layer][slots] = float("nan")
        return count


@pytest.mark.parametrize("chunk", [None, 7])
def test_offloaded_preemption_changes_no_token_and_skips_recomputation(gpt_tiny_generator, chunk):
    def run(offload: bool):
        policy = SchedulerPolicy(context=gpt_tiny_generator.context, prefill_chunk=chunk, kv_offload=offload)
        sched = Scheduler(gpt_tiny_generator.runner, OverwritingAllocator(24, 8, gpt_tiny_generator.runner.storage), policy)
        params = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=25, temperature=0.8, seed=3), SamplingParams(max_tokens=20)]
        reqs = [sched.submit(prompt(n, i), p) for i, (n, p) in enumerate(zip((50, 40, 60), params))]
        sched.run_until_done()
        return [r.output for r in reqs], sched.stats

    (recomputed, plain), (offloaded, stats) = run(False), run(True)
    assert offloaded == recomputed and plain["preemptions"] > 0 and stats["preemptions"] > 0
    assert stats["restored_tokens"] > 0 and stats["restored_tokens"] == stats["offloaded_tokens"]
    assert stats["prefill_tokens"] < plain["prefill_tokens"]  # what came back from host memory was not recomputed
