"""LoRA on a frozen base that ZeRO-3 shards or offload streams: the base's units are gathered for compute only (no
gradient, no reduce-scatter, no optimizer state), the adapters stay whole with their Adam state, and training equals
single-process LoRA (loss per step and adapter weights, float32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist import run_ranks
from tests.test_lora import assert_same_training, behemoth_lora, folder, lora_config, peft_adapters, peft_model  # noqa: F401  (folder: a fixture)

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def init(folder, tmp_path_factory) -> dict[str, Any]:  # noqa: F811
    """The adapters' initial values (peft's, A and B random) every run starts from."""
    return peft_adapters(peft_model(folder))


@pytest.fixture(scope="module")
def single(folder, init, tmp_path_factory) -> dict[str, Any]:  # noqa: F811
    return run_ranks(1, behemoth_lora, lora_config(tmp_path_factory.mktemp("one"), folder), init)[0]


def adapter_bytes(single: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in single["adapters"].values())


def test_lora_under_zero3_equals_one_process(folder, init, single, tmp_path):  # noqa: F811
    """ZeRO-3 over 2 ranks shards the frozen base (half of it per rank, no gradient or optimizer state for it); the
    adapters are whole on every rank and all-reduced: the single-process curve and adapters."""
    got = run_ranks(2, behemoth_lora, lora_config(tmp_path, folder, "parallel.dp=2", "parallel.zero_stage=3"), init)
    base = single["states"]["params"] - adapter_bytes(single)
    for rank in got:
        assert_same_training(single, rank)
        assert not rank["held"]  # every base parameter lives in a unit's shard
        states = rank["states"]
        assert states["grads"] == adapter_bytes(single) and states["optimizer"] == 2 * adapter_bytes(single), states
        assert states["params"] - adapter_bytes(single) <= base // 2 + 1024, (states, base)  # half the base (+ padding)


@pytest.mark.parametrize(
    "layout",
    [
        ("offload.params=disk",),
        pytest.param(("offload.params=host", "parallel.dp=2"), marks=pytest.mark.slow),
        ("offload.params=disk", "parallel.tp=2"),
        pytest.param(("offload.params=host", "parallel.tp=2"), marks=pytest.mark.slow),
    ],
    ids=["disk", "host-dp2", "disk-tp2", "host-tp2"],
)
def test_lora_with_an_offloaded_base_equals_one_process(folder, init, single, tmp_path, layout):  # noqa: F811
    """The frozen base streams unit by unit (from the folder itself at offload.params=disk: nothing written, no scratch
    copy, no gradient or moment of it anywhere); the adapters and their Adam state stay resident: the single-process
    curve and adapters."""
    world = 2 if "parallel.dp=2" in layout or "parallel.tp=2" in layout else 1
    got = run_ranks(world, behemoth_lora, lora_config(tmp_path, folder, *layout, f"offload.dir={tmp_path / 'scratch'}"), init)
    for rank in got:
        assert_same_training(single, rank)
        assert not rank["held"]
        states, adapters = rank["states"], rank["local_adapter_bytes"]
        assert states["grads"] == adapters and states["optimizer"] == 2 * adapters, states
        assert set(rank["optim"]["model"]) == set(single["adapters"])  # checkpoints hold the adapters only
    if "parallel.tp=2" in layout:  # each tp rank holds (and, from the folder, reads) its half of the split weights
        assert all(rank["local_adapter_bytes"] < adapter_bytes(single) for rank in got)
        if "offload.params=disk" in layout:
            whole = run_ranks(1, behemoth_lora, lora_config(tmp_path / "one", folder, *layout[:1], f"offload.dir={tmp_path / 's1'}"), init)[0]
            for rank in got:  # the norms are replicated: a little over half
                assert 0.5 * whole["read_mb"] < rank["read_mb"] < 0.6 * whole["read_mb"], (rank["read_mb"], whole["read_mb"])


def train_run(cfg_dict: dict[str, Any], resume: str | None = None) -> dict[str, Any]:
    """A LoRA run through the trainer (data, adapter-only checkpoints); its losses and the adapters it wrote at the end."""
    from pathlib import Path

    from safetensors.torch import load_file

    from behemoth.config import Config
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer

    cfg = Config.model_validate(cfg_dict)
    trainer = Trainer(cfg, init_runtime(timeout_s=cfg.run.timeout_s), resume=Path(resume) if resume else None)
    summary = trainer.run()
    return {
        "losses": summary["losses"],
        "start": trainer.start_step,
        "adapters": load_file(str(Path(cfg.run.dir) / "adapter" / "adapter_model.safetensors")),
    }


@pytest.mark.slow
def test_offloaded_lora_checkpoints_hold_adapters_and_resume(folder, tmp_path):  # noqa: F811
    """A streamed-base LoRA run's checkpoint holds the adapters and their optimizer state only; resumed from it (the base
    read from the folder again) the run continues the uninterrupted curve to the same adapters."""
    from torch.distributed.checkpoint import FileSystemReader

    options = ("train.steps=4", "checkpoint.every=2", "checkpoint.async_save=false", "offload.params=disk")
    full = run_ranks(1, train_run, lora_config(tmp_path / "full", folder, *options, f"offload.dir={tmp_path / 's1'}"))[0]
    ckpt = tmp_path / "full" / "checkpoints" / "step_0000002"
    stored = [k for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith(("model.", "optim."))]
    assert stored and all(".lora_A." in k or ".lora_B." in k for k in stored), sorted(stored)  # no base weight, no moment of one
    assert len([k for k in stored if k.startswith("model.")]) == len(full["adapters"])
    resumed = run_ranks(1, train_run, lora_config(tmp_path / "again", folder, *options, f"offload.dir={tmp_path / 's2'}"), str(ckpt))[0]
    assert resumed["start"] == 2
    assert_same_training({"losses": full["losses"][2:], "adapters": full["adapters"]}, resumed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_split_tensor_is_read_alone_from_its_file(tmp_path, dtype):
    """Each tp rank's part of a stored tensor (rows, columns row by row, a fused layer's pieces, padded vocabulary rows)
    read from its safetensors file equals the part cut from the whole tensor, in float32, reading only the part's bytes."""
    from safetensors.torch import save_file

    from behemoth.models.safetensors_io import read_index
    from behemoth.offload.frozen import read_split
    from behemoth.parallel.tensor.comm import TPComm
    from behemoth.parallel.tensor.layers import ShardLayout

    full = torch.randn(10, 12, 3).to(dtype)
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    entry = read_index([tmp_path / "model.safetensors"])["w"]
    layouts = [
        *(ShardLayout.split("w", full.shape, 0, TPComm(None, 2, r)) for r in range(2)),  # type: ignore[arg-type]  # a layout reads size and rank only
        *(ShardLayout.split("w", full.shape, 1, TPComm(None, 2, r), parts=3) for r in range(2)),  # type: ignore[arg-type]
        *(ShardLayout.padded(full.shape, 0, TPComm(None, 3, r)) for r in range(3)),  # type: ignore[arg-type]  # 4, 4, 2 rows
    ]
    for layout in layouts:
        part, read = read_split(entry, layout)
        assert torch.equal(part, layout.take_local(full.float())), layout
        assert read == sum(length for _, _, length in layout.pieces) * full.numel() // full.shape[layout.dim] * dtype.itemsize, layout


def zero_gradient_sent_back() -> None:
    """The control of a streamed pipeline: the last stage sends back a zero gradient, so the first stage's adapters
    never learn (this process only)."""
    from behemoth.offload.stage_stream import StageStreams

    end_pass = StageStreams.end_pass

    def dropped(self: StageStreams, kind: str, stage: int, mb: int, step: Any, state: Any) -> None:
        end_pass(self, kind, stage, mb, step, state)
        if kind in ("B", "BI") and stage > 0:
            step.mailbox[("grad", stage, mb)].zero_()

    StageStreams.end_pass = dropped  # type: ignore[method-assign]


def piped_lora(cfgs: list[dict[str, Any]], init: dict[str, Any], control: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """`behemoth_lora` of each config in turn under a streamed pipeline, then of `control` with a zero gradient sent back."""
    out = [behemoth_lora(cfg, init) for cfg in cfgs]
    if control is not None:
        zero_gradient_sent_back()
        out.append(behemoth_lora(control, init))
    return out


def piped_options(tmp_path: Any, name: str, tier: str, schedule: str) -> tuple[str, ...]:
    return ("parallel.pp=2", f"parallel.schedule={schedule}", "parallel.microbatches=2", f"offload.params={tier}", f"offload.dir={tmp_path / name}")


def check_piped_lora(single: dict[str, Any], got: list[dict[str, Any]]) -> dict[str, Any]:
    """Each stage holds its blocks' adapters and their Adam state, no gradient or moment of the base; the merged run (the
    last stage's losses)."""
    assert not set(got[0]["adapters"]) & set(got[1]["adapters"])
    for rank in got:
        states, adapters = rank["states"], rank["local_adapter_bytes"]
        assert not rank["held"] and states["grads"] == adapters and states["optimizer"] == 2 * adapters, states
    return {"losses": got[1]["losses"], "adapters": {**got[0]["adapters"], **got[1]["adapters"]}}


def test_lora_with_a_base_streamed_by_pipeline_stages_equals_one_process(folder, init, single, tmp_path):  # noqa: F811
    """pp=2 under 1f1b, the base in host memory: each stage streams its part of the frozen base (read-only) and keeps its
    blocks' adapters resident: the single-process curve and adapters; a stage that sends back no gradient misses them
    (the control)."""
    cfg = lora_config(tmp_path / "run", folder, *piped_options(tmp_path, "s1", "host", "1f1b"))
    control = lora_config(tmp_path / "control", folder, *piped_options(tmp_path, "s2", "host", "1f1b"))
    ranks = run_ranks(2, piped_lora, [cfg], init, control)
    assert_same_training(single, check_piped_lora(single, [r[0] for r in ranks]))
    with pytest.raises(AssertionError):
        assert_same_training(single, check_piped_lora(single, [r[1] for r in ranks]))


@pytest.mark.slow
def test_lora_base_streamed_from_its_folder_or_under_a_split_backward_equals_one_process(folder, init, single, tmp_path):  # noqa: F811
    """pp=2 with the base read from the model folder itself (gpipe, offload.params=disk) and under zb-h1 (the adapters
    learn in the W passes): the single-process curve and adapters."""
    layouts = [("disk", "gpipe"), ("host", "zb-h1")]
    cfgs = [lora_config(tmp_path / f"r{i}", folder, *piped_options(tmp_path, f"s{i}", *layout)) for i, layout in enumerate(layouts)]
    ranks = run_ranks(2, piped_lora, cfgs, init)
    for i in range(len(layouts)):
        assert_same_training(single, check_piped_lora(single, [r[i] for r in ranks]))
