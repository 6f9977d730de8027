"""LoRA on a frozen base that ZeRO-3 shards or offload streams: the base's units are gathered for compute only (no
gradient, no reduce-scatter, no optimizer state), the adapters stay whole with their Adam state, and training equals
single-process LoRA (loss per step and adapter weights, float32)."""

from __future__ import annotations

from typing import Any

import pytest

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
