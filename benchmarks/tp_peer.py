"""The DTensor side of benchmarks/bench_tp.py: torch's parallelize_module plan for behemoth's GPT (torchtitan's recipe),
its optimizer groups, gradient clipping over mixed DTensor and plain parameters, and the fused qkv rows permuted so
DTensor's contiguous shards hold whole heads."""

from __future__ import annotations

from typing import Any


def split_optimizer(model: Any, train: Any) -> Any:
    """behemoth's AdamW groups, each split into DTensor and plain parameters (foreach cannot mix them)."""
    import torch
    from torch.distributed.tensor import DTensor

    groups = []
    for decay in (True, False):
        for dtensor in (True, False):
            ps = [p for p in model.parameters() if (p.dim() >= 2) == decay and isinstance(p, DTensor) == dtensor]
            if ps:
                groups.append({"params": ps, "weight_decay": train.weight_decay if decay else 0.0})
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), foreach=True)


def clip_mixed(params: list, max_norm: float, group: Any) -> float:
    """Global norm over split DTensors (shard norms summed over tp) and replicated tensors (once), one all-reduce.

    torch's clip_grad_norm_ refuses the mix of DTensor and plain parameters that parallelize_module leaves.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sharded = [p.grad._local_tensor for p in params if isinstance(p, DTensor) and p.grad is not None and any(pl.is_shard() for pl in p.placements)]
    whole = [
        (p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad)
        for p in params
        if p.grad is not None and not (isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements))
    ]
    sq = torch.stack(
        [
            torch.stack(torch._foreach_norm(sharded)).square().sum(),
            torch.stack(torch._foreach_norm(whole)).square().sum() / dist.get_world_size(group),
        ]
    )
    total = sq.sum()
    dist.all_reduce(total, group=group)
    norm = total.sqrt()
    torch._foreach_mul_(sharded + whole, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return float(norm)


def permute_qkv_rows(model: Any, tp: int) -> None:
    """[q|k|v] rows -> [q_0|k_0|v_0|q_1|k_1|v_1...]: DTensor's contiguous Shard(0) then gives each rank whole heads."""
    import torch

    with torch.no_grad():
        for block in model.blocks:
            for p in (block.attn.qkv.weight, block.attn.qkv.bias):
                if p is None:
                    continue
                parts = [part.chunk(tp) for part in p.chunk(3)]
                p.copy_(torch.cat([parts[j][r] for r in range(tp) for j in range(3)]))


def dtensor_plan(model: Any, sp: bool) -> dict[str, Any]:
    """behemoth's GPT plan in torch's styles (torchtitan's recipe for sequence parallelism)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    seq = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True)
        plan["ln_f"] = SequenceParallel()
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        plan.update(
            {
                f"{b}.attn.qkv": ColwiseParallel(),
                f"{b}.attn.proj": RowwiseParallel(output_layouts=seq),
                f"{b}.mlp.fc": ColwiseParallel(),
                f"{b}.mlp.proj": RowwiseParallel(output_layouts=seq),
            }
        )
        if sp:
            plan.update(
                {
                    f"{b}.ln_1": SequenceParallel(),
                    f"{b}.ln_2": SequenceParallel(),
                    # the attention's second input is its KV cache (None while training): no layout
                    f"{b}.attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
                    f"{b}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                }
            )
    return plan
