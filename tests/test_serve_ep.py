"""Serving features under expert parallelism (`--ep 2`, gloo, bounded waits): on a random Mixtral folder, a scheduler
with too few blocks preempts, and KV offload (each rank copies its own copy of the layers' keys and values to host
memory and back), n-gram speculation and a draft model (whole on job rank 0) give one process's greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist import run_ranks
from tests.test_serve_tp import GREEDY, PARAMS, _serve

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from tests.test_generate_offload import save_mixtral

    folder = str(tmp_path_factory.mktemp("mixtral"))
    save_mixtral(folder)
    config = Path(folder) / "config.json"  # a context for the longest request (21 prompt + 16 new tokens); default RoPE
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_position_embeddings": 64}))
    return folder


@pytest.fixture(scope="module")
def one_process(mixtral):
    """One process, recomputation at preemption, no speculation."""
    out, stats = run_ranks(1, _serve, mixtral, 1, 1, False, False, timeout=90)[0]
    assert stats["preemptions"] > 0
    return out, stats


def greedy_rows(out: list[list[int]]) -> list[list[int]]:
    return [o for o, sp in zip(out, PARAMS) if sp is GREEDY]


def test_kv_offload_and_ngram_speculation_under_ep_equal_one_process(mixtral, one_process):
    ranks = run_ranks(2, _serve, mixtral, 1, 1, True, True, None, None, 2, timeout=120)
    out, stats = ranks[0]
    assert greedy_rows(out) == greedy_rows(one_process[0]) and ranks[1] is None and len(out[1]) == 16
    assert stats["preemptions"] > 0 and stats["restored_tokens"] == stats["offloaded_tokens"] > 0
    assert stats["draft_tokens"] > 0 and stats["prefill_tokens"] < one_process[1]["prefill_tokens"]


@pytest.mark.slow
def test_a_draft_model_under_ep_gives_the_one_process_greedy_tokens(mixtral, one_process):
    """The target (its experts split over two processes) as its own draft, whole on job rank 0: the proposals are the
    target's own choices, so (nearly) all are kept."""
    out, stats = run_ranks(2, _serve, mixtral, 1, 1, False, mixtral, None, None, 2, timeout=120)[0]
    assert greedy_rows(out) == greedy_rows(one_process[0])
    assert stats["accepted_tokens"] > 0.9 * stats["draft_tokens"] > 0 and stats["steps"] < one_process[1]["steps"]
