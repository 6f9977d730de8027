"""`behemoth train` with a burst plan (parallel.burst, as `behemoth plan --burst --out` writes it) gives the
single-process curve: float32 losses and weights after AdamW steps with global-norm clipping, every rank holding the
same weights; a checkpoint of a burst run resumes on the same curve; combinations it cannot run are refused in one line
before launch."""

from __future__ import annotations

import shutil

import pytest

from tests.common import assert_close_runs, tiny_config
from tests.dist import run_ranks

CKPT6 = "checkpoints/step_0000006"
# gpt-tiny: embedding, 2 blocks, head; a tied head, so the embedding's weight is used at width 1 and 2
PLAN_2 = "[1,2,1,2]"
COMMON = ("checkpoint.every=6", "train.grad_clip=0.05")  # a clip that binds: the global norm over every layer's gradient


def break_overlap(broken: str) -> None:
    """Controls: the overlapped sums waited for but not copied into the gradients ("no_copy"), or started and never
    waited for nor copied in ("no_finish")."""
    from behemoth.parallel.burst.runtime import BurstModel
    from behemoth.parallel.burst.train import BurstSync

    def wait_only(self: BurstModel, width: int) -> None:
        for handle, _, _ in self._pending.pop(width, []):
            handle.wait()

    def drop(self: BurstSync) -> None:
        self.burst._pending.pop(self.width, None)

    if broken == "no_copy":
        BurstModel._finish_sums = wait_only  # type: ignore[method-assign]
    elif broken == "no_finish":
        BurstSync.finish = drop  # type: ignore[method-assign]


def burst_body(cfg_dict: dict, resume: str | None = None, broken: str | None = None) -> dict:
    """Train under the current process group; every rank returns its losses and its own weights."""
    from pathlib import Path

    from behemoth.config import Config
    from behemoth.parallel.burst.train import BurstSteps
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer

    if broken:
        break_overlap(broken)
    cfg = Config.model_validate(cfg_dict)
    rt = init_runtime(timeout_s=cfg.run.timeout_s, **cfg.parallel.degrees())
    trainer = Trainer(cfg, rt, resume=Path(resume) if resume else None)
    summary = trainer.run()
    model = trainer.engine.model
    weights = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    norms = [r.grad_norm for r in trainer.history]
    burst = isinstance(model.executor, BurstSteps)
    held = trainer.engine.model_state_bytes()
    early = model.executor.burst.early_sums if burst else 0
    out = {"losses": summary["losses"], "weights": weights, "start": trainer.start_step, "burst": burst, "norms": norms, "early_sums": early}
    return out | {"held_bytes": held["params"] + held["optimizer"], "eval": [v for _, v in trainer.val_history]}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_ranks(1, burst_body, tiny_config(tmp_path_factory.mktemp("single"), *COMMON))[0]


@pytest.fixture(scope="module")
def burst_on_2(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("burst2")
    return run_dir, run_ranks(2, burst_body, tiny_config(run_dir, *COMMON, f"parallel.burst={PLAN_2}"))


def _assert_replicas_equal(results: list[dict]) -> None:
    """Every rank's copy of a parameter it holds equals rank 0's (rank 0 is in every layer's group: it holds all)."""
    for other in results[1:]:
        for name, w in results[0]["weights"].items():
            if other["weights"][name].numel():
                assert (other["weights"][name] - w).abs().max().item() == 0.0, f"{name}: ranks hold different weights"


def _layers_using(name: str, n_layer: int, tied: bool) -> list[int]:
    """The layers (0: embedding, 1 .. n_layer: blocks, n_layer + 1: head) of gpt-tiny that use parameter `name`."""
    if name.startswith("blocks."):
        return [int(name.split(".")[1]) + 1]
    if name.startswith(("wte.", "wpe.")):
        return [0, n_layer + 1] if tied and name.startswith("wte.") else [0]
    return [n_layer + 1]


def _assert_each_rank_holds_its_layers(single: dict, results: list[dict], widths: list[int], tied: bool) -> None:
    """Rank r holds (and keeps AdamW state for) exactly the parameters of layers at least r + 1 wide: their bytes x 3."""
    for rank, got in enumerate(results):
        held = {n for n, w in got["weights"].items() if w.numel()}
        wanted = {n for n in single["weights"] if max(widths[i] for i in _layers_using(n, len(widths) - 2, tied)) > rank}
        wanted -= {"lm_head.weight"} if tied else set()  # the head's tied weight is the embedding's, counted once
        assert held == wanted | ({"lm_head.weight"} & held), f"rank {rank} holds {sorted(held ^ wanted)} it should not, or lacks them"
        size = sum(single["weights"][n].numel() * 4 for n in wanted)
        assert got["held_bytes"] == 3 * size, f"rank {rank}: parameter + AdamW bytes {got['held_bytes']} vs {3 * size}"


def test_burst_plan_trains_like_single_process(single, burst_on_2):
    """The trainer's sums overlap backward (the blocks' and the head's start before the embedding's backward) and
    give the single-process losses, clipped norms and weights."""
    _, results = burst_on_2
    assert all(r["burst"] for r in results)
    assert results[0]["early_sums"] > 0 and results[1]["early_sums"] > 0, "no gradient sum started during backward"
    assert min(single["norms"]) > 0.05, "the clip must bind for the test to cover clipping"
    assert_close_runs(single, results[0])
    for a, b in zip(single["norms"], results[0]["norms"]):
        assert abs(a - b) <= 1e-4 * a, f"global grad norm {b} vs single process {a}"
    _assert_replicas_equal(results)


@pytest.mark.parametrize("broken", ["no_copy", "no_finish"])
def test_overlapped_sums_not_copied_or_not_awaited_would_be_caught(single, broken, tmp_path):
    """The equivalence above can fail: with the sums not copied back, or never waited for, step 2 onward leaves the
    single-process curve (step 1's loss precedes any update, so it still agrees)."""
    got = run_ranks(2, burst_body, tiny_config(tmp_path, *COMMON, "train.steps=3", f"parallel.burst={PLAN_2}"), None, broken)[0]["losses"]
    ref = single["losses"][:3]
    assert abs(got[0] - ref[0]) <= 1e-5 * abs(ref[0])
    assert any(abs(a - b) > 1e-5 * abs(a) for a, b in zip(ref[1:], got[1:])), f"{broken}: losses {got} still equal {ref}"


def test_burst_checkpoint_resumes_the_same_curve(burst_on_2, tmp_path):
    run_dir, results = burst_on_2
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    resumed = run_ranks(2, burst_body, tiny_config(copy, *COMMON, f"parallel.burst={PLAN_2}"), str(copy / CKPT6))
    assert resumed[0]["start"] == 6 and len(resumed[0]["losses"]) == 6
    assert_close_runs({"losses": results[0]["losses"][6:], "weights": results[0]["weights"]}, resumed[0], loss_rtol=1e-6, weight_rtol=1e-6)
    _assert_replicas_equal(resumed)


def test_plan_burst_out_is_a_config_train_runs(tmp_path, capsys):
    from behemoth.cli import main
    from behemoth.config import load_config

    out = tmp_path / "burst.yaml"
    argv = ["plan", "--burst", "--nproc", "2", "model=gpt-tiny", "train.global_batch=8", "train.seq_len=32", "--out", str(out)]
    assert main(argv) == 0
    assert f"behemoth train --nproc 2 --config {out}" in capsys.readouterr().out
    cfg = load_config(str(out), [])
    assert cfg.parallel.burst is not None and len(cfg.parallel.burst) == 4 and max(cfg.parallel.burst) <= 2
    assert cfg.train.global_batch == 8 and cfg.model.n_layer == 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["parallel.burst=[1,2,2]"], "parallel.burst has 3 widths for 4 layers"),
        (["parallel.burst=[1,3,2,2]"], "parallel.burst widths [3] outside 1..2"),
        (["parallel.burst=[1,2,1,2]", "parallel.zero_stage=1"], "parallel.burst with parallel.zero_stage=1"),
        (["parallel.burst=[1,2,1,2]", "parallel.tp=2"], "parallel.burst with parallel.tp=2"),
    ],
)
def test_burst_refusals_are_one_line_before_launch(extra, message, tmp_path, capsys):
    from behemoth.cli import main

    argv = ["train", "--nproc", "2", "model=gpt-tiny", "train.global_batch=8", "train.seq_len=32", f"run.dir={tmp_path}/run", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("behemoth: error:") and "\n" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["[4,1,4,4]", "[1,4,1,4]"])
def test_burst_plan_on_four_ranks(single, plan, tmp_path):
    results = run_ranks(4, burst_body, tiny_config(tmp_path, *COMMON, f"parallel.burst={plan}"))
    assert_close_runs(single, results[0])
    _assert_replicas_equal(results)


def groups_then_local_group(widths: list[int]) -> int:
    """Burst groups for `widths`, then a group made with use_local_synchronization (as the checkpoint saver makes its
    own) and one all-reduce on it; the sum."""
    import torch
    import torch.distributed as dist

    from behemoth.parallel.burst import BurstGroups

    BurstGroups.of(widths, dist.group.WORLD, torch.device("cpu"))
    group = dist.new_group(list(range(dist.get_world_size())), backend="gloo", use_local_synchronization=True)
    one = torch.ones(1)
    dist.all_reduce(one, group=group)
    return int(one.item())


def test_middle_widths_leave_later_local_groups_working():
    """Widths 2 and 3 on 4 ranks: c10d names a locally synchronized group by the count of groups a rank belongs to, so
    uneven memberships (3, 3, 2, 1) gave every rank another name and the rendezvous hung; BurstGroups evens them."""
    assert run_ranks(4, groups_then_local_group, [2, 4, 1, 3], timeout=60) == [4, 4, 4, 4]


def test_middle_widths_on_four_ranks_train_like_single_process(tmp_path):
    """(2, 4, 1, 3) on 4 ranks with a tied head (the embedding's weight at widths 2 and 3): the single-process losses,
    clipped norms, evaluation losses and weights; rank 3 holds block 0 only, and its parameter + AdamW bytes say so;
    the checkpoint the four ranks wrote together resumes in a single process."""
    tied = (*COMMON, "model.tie_embeddings=true")
    single = run_ranks(1, burst_body, tiny_config(tmp_path / "single", *tied))[0]
    results = run_ranks(4, burst_body, tiny_config(tmp_path / "burst", *tied, "parallel.burst=[2,4,1,3]"), timeout=120)
    assert all(r["burst"] for r in results)
    assert_close_runs(single, results[0])
    for a, b in zip(single["norms"], results[0]["norms"]):
        assert abs(a - b) <= 1e-4 * a, f"global grad norm {b} vs single process {a}"
    evals = list(zip(single["eval"], results[0]["eval"], strict=True))
    assert evals and all(b == pytest.approx(a, rel=1e-5) for a, b in evals), f"evaluation losses {evals}"
    _assert_replicas_equal(results)
    _assert_each_rank_holds_its_layers(single, results, [2, 4, 1, 3], tied=True)
    # the ranks' union is the whole model: its step-6 checkpoint resumes in one process (no burst) on the same curve
    copy = tmp_path / "resumed"
    shutil.copytree(tmp_path / "burst", copy)
    resumed = run_ranks(1, burst_body, tiny_config(copy, *tied), str(copy / CKPT6))[0]
    assert resumed["start"] == 6
    assert_close_runs({"losses": results[0]["losses"][6:], "weights": results[0]["weights"]}, resumed)
