"""The pipeline executor's kept receive buffers: a buffer is reused only once nothing refers to its memory (autograd's
saved tensors, views, a kept gradient), a step's receives reuse the previous step's buffers; and the step's loss summed
over the pipeline in the background is the same number as the blocking sum."""

from __future__ import annotations

from pathlib import Path

import torch

from behemoth.parallel.pipeline.buffers import RecvBuffers
from tests.common import tiny_config
from tests.dist import run_ranks

SHAPE = (2, 8, 4)


def test_buffer_saved_by_autograd_is_not_reused_until_its_graph_is_gone():
    buffers = RecvBuffers(torch.device("cpu"))
    x = buffers.take(SHAPE, torch.float32).fill_(1.0).requires_grad_()
    w = torch.full(SHAPE, 2.0, requires_grad=True)
    loss = (x * w).sum()  # saves x for w's gradient
    address = x.data_ptr()
    del x  # only autograd holds the received tensor now
    y = buffers.take(SHAPE, torch.float32)
    assert y.data_ptr() != address, "a buffer autograd still holds was handed out again"
    y.fill_(5.0)  # a later message lands elsewhere...
    loss.backward()
    assert torch.equal(w.grad, torch.ones(SHAPE)), "...so the backward reads the activation it saved"
    del loss, y
    assert buffers.take(SHAPE, torch.float32).data_ptr() == address, "a buffer nothing holds is reused"
    assert (buffers.allocated, buffers.reused) == (2, 1)


def test_views_and_kept_gradients_keep_their_buffer():
    buffers = RecvBuffers(torch.device("cpu"))
    grad = buffers.take(SHAPE, torch.float32)
    view, address = grad[0], grad.data_ptr()  # a deferred weight pass may keep a view of the received gradient
    del grad
    assert buffers.take(SHAPE, torch.float32).data_ptr() != address
    del view
    assert buffers.take(SHAPE, torch.float32).data_ptr() == address
    other = buffers.take(SHAPE, torch.float64)  # another dtype has its own slots
    assert other.dtype == torch.float64 and other.data_ptr() != address


def test_shapes_a_step_did_not_receive_are_dropped():
    buffers = RecvBuffers(torch.device("cpu"))
    buffers.take(SHAPE, torch.float32)
    buffers.end_step()
    buffers.take((1, 8, 4), torch.float32)
    buffers.end_step()
    assert list(buffers.slots) == [((1, 8, 4), torch.float32)] and buffers.held_bytes() == 1 * 8 * 4 * 4


def _steps_body(cfg_dict: dict) -> dict:
    """Three training steps on a pipeline: per step, the engine's loss, this rank's share, the receive buffers."""
    import torch.distributed as dist

    from behemoth.comm import all_reduce
    from behemoth.config import Config
    from behemoth.data import BatchSampler, prepare_corpus
    from behemoth.engine import build_engine
    from behemoth.topology import ParallelDims, init_runtime

    cfg = Config.model_validate(cfg_dict)
    rt = init_runtime(timeout_s=cfg.run.timeout_s, **cfg.parallel.degrees())
    engine = build_engine(cfg, rt)
    corpus = prepare_corpus(cfg.data.path, cfg.data.val_fraction, cfg.data.cache_dir)
    sampler = BatchSampler(corpus.train, cfg.seq_len, cfg.batch_layout(ParallelDims(1)), 0, cfg.train.seed)
    pipe, out = engine.model.pipeline, []
    for step in range(3):
        result = engine.train_step(sampler.micro_batches(step), 1e-3)
        share = pipe.last_trace.loss.clone()
        all_reduce(share, rt.group("pp"))  # the blocking sum the engine used to do after the optimizer step
        buffers = pipe.executor.buffers
        out.append({"loss": result.loss, "summed": float(share), "allocated": buffers.allocated, "reused": buffers.reused})
    # the background sum and another collective in between on the same group, as the engine's step has (the clipping norm)
    t = torch.tensor([float(dist.get_rank() + 1)])
    finish = engine.model.start_reduce_over_batch(t)
    between = torch.tensor([10.0 * (dist.get_rank() + 1)])
    all_reduce(between, rt.group("pp"))
    return {"steps": out, "background": float(finish()), "between": float(between)}


def test_receives_reuse_buffers_and_the_loss_is_the_blocking_sum(tmp_path: Path):
    cfg = tiny_config(tmp_path, "model.n_layer=4", "parallel.pp=2", "parallel.schedule=1f1b", "parallel.microbatches=4")
    got = run_ranks(2, _steps_body, cfg)
    for rank in got:
        steps = rank["steps"]
        assert [s["loss"] for s in steps] == [s["summed"] for s in steps], "the logged loss changed"
        assert steps[0]["allocated"] <= 2, "1F1B at p=2 holds at most two received activations (or gradients) at once"
        assert steps[2]["allocated"] == steps[0]["allocated"], "later steps allocate no receive buffer"
        assert steps[2]["reused"] - steps[1]["reused"] == 4, "each of a step's 4 receives reuses a kept buffer"
        assert (rank["background"], rank["between"]) == (3.0, 30.0)
    assert [s["loss"] for s in got[0]["steps"]] == [s["loss"] for s in got[1]["steps"]], "ranks disagree on the loss"
