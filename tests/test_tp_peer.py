"""benchmarks/bench_tp.py's peer: behemoth's GPT under torch's DTensor `parallelize_module` (torchtitan's recipe) trains
the same first steps as behemoth's own tensor parallelism, with and without sequence parallelism, on 2 gloo ranks. The
SP plan had stopped running when the GPT attention took its KV cache as a second input (the peer's PrepareModuleInput
named one layout for two inputs); this keeps the benchmark's table printable."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist import run_ranks

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_dtensor_peer_trains_behemoths_losses(monkeypatch, sp):
    """Two steps of gpt-1m at tp=2: DTensor's per-step losses within 1e-5 of behemoth's (same init, batches, AdamW)."""
    monkeypatch.syspath_prepend(BENCHMARKS)  # the ranks get this sys.path (multiprocessing's preparation data)
    from bench_tp import bench_rank, make_config

    cfg = make_config("gpt-1m", sp)
    ours = run_ranks(2, bench_rank, "behemoth", cfg, 1, 1, timeout=300)[0]["losses"]
    peer = run_ranks(2, bench_rank, "dtensor", cfg, 1, 1, timeout=300)[0]["losses"]
    assert len(ours) == len(peer) == 2
    for a, b in zip(ours, peer):
        assert abs(a - b) <= 1e-5 * abs(a), (ours, peer)
