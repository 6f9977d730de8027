"""Published training runs as rows the cost model can price: benchmarks/published/*.yaml.

Each file is one source (a paper, a report, a project's performance page) with the hardware preset it ran on (and
what differs from it: a network, an attention kernel), how it counts throughput, and one row per run: model shape,
layout (tp, pp, data parallel = GPUs / (tp x pp)), batch, micro-batch, recomputation, the published figure and
where in the source it stands. `validate` prices every row with one function (`price`, the schedule simulator for
every pipelined row) and sets predicted tokens per second per GPU beside the published ones.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from behemoth.errors import BehemothError
from behemoth.planner.cluster import ClusterSpec, load_cluster
from behemoth.planner.cost import PlanCost, planned_bounds, price
from behemoth.planner.layout import Layout, Workload

PUBLISHED_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "published"
METRICS = ("tflops_megatron", "seconds_per_iteration", "tokens_per_gpu")


@dataclass
class PublishedRow:
    """One published run, priced: per-GPU tokens per second as published and as predicted."""

    source: str
    name: str
    where: str
    layout: str
    published: float  # tokens / s / GPU
    predicted: float
    cost: PlanCost

    @property
    def ratio(self) -> float:
        return self.predicted / self.published


def megatron_flops_per_token(n_layer: int, d_model: int, seq_len: int, vocab: int) -> float:
    """Narayanan et al. 2021, Section 5.1: 96 l h^2 (1 + s / 6h + V / 16 l h) FLOPs per token, recomputation included."""
    return 96.0 * n_layer * d_model**2 * (1 + seq_len / (6 * d_model) + vocab / (16 * n_layer * d_model))


def config_options(row: dict[str, Any]) -> list[str]:
    """The `behemoth` options of a row's model, batch and precision."""
    s = row["seq_len"]
    shape = [f"model.n_layer={row['n_layer']}", f"model.d_model={row['d_model']}", f"model.n_head={row['n_head']}"]
    shape += [f"model.vocab_size={row['vocab_size']}", f"model.context={s}"]
    if row["family"] == "llama":
        shape = ["model=hf:llama", *shape, f"hf.kv_heads={row['kv_heads']}", f"hf.ffn={row['ffn']}"]
    elif row["family"] == "gpt":
        shape.append("model.tie_embeddings=true")
    else:
        raise BehemothError(f"published row {row['name']}: family={row['family']} is not gpt or llama", "write family: gpt or family: llama")
    if row.get("dropout"):
        shape.append(f"model.dropout={row['dropout']}")
    run = [f"train.seq_len={s}", f"train.global_batch={row['global_batch']}", "train.precision=bf16", "parallel.param_dtype=bf16"]
    return shape + run + [f"parallel.zero_stage={max(1, row['zero'])}"]


def row_layout(row: dict[str, Any]) -> Layout:
    """The layout a row states: data parallel = GPUs / (tp x pp), micro-batches = batch / (dp x micro-batch), the schedule
    and its chunks per rank (`chunks`, v of the interleaved schedule; default 1); recompute
    `all` (every block), `none`, or `op` (an op-level policy: no block recomputed whole, see `Workload.op_checkpointing`)."""
    tp, pp, gpus, mb = row["tp"], row["pp"], row["gpus"], row["micro_batch"]
    dp, rest = divmod(gpus, tp * pp)
    m, left = divmod(row["global_batch"], max(1, dp) * mb)
    if rest or left or m < 1:
        raise BehemothError(
            f"published row {row['name']}: {gpus} GPUs, tp={tp}, pp={pp}, batch {row['global_batch']}, micro-batch {mb} do not divide",
            "state a layout whose degrees divide the GPUs and whose data ranks divide the batch",
        )
    if row["recompute"] not in ("all", "none", "op"):
        raise BehemothError(f"published row {row['name']}: recompute={row['recompute']!r} is not all, none or op", "write recompute: all, none or op")
    recompute = tuple(range(pp)) if row["recompute"] == "all" else ()
    return Layout(dp, tp, pp, row["zero"], False, mb, m, row["schedule"], row.get("chunks", 1), recompute)


def source_cluster(source: dict[str, Any], gpus: int, device: dict[str, Any] | None = None) -> ClusterSpec:
    """The source's preset with what the source says differs (device fields, the network), for `gpus` devices; `device`:
    fields set on top (a fit's trial value)."""
    cluster = load_cluster(source["cluster"]).with_nodes(gpus)
    update = {**source.get("device", {}), **(device or {})}
    if update:
        cluster = cluster.model_copy(update={"device": cluster.device.model_copy(update=update)})
    if source.get("inter_node") and cluster.inter_node is not None:
        cluster = cluster.model_copy(update={"inter_node": cluster.inter_node.model_copy(update=source["inter_node"])})
    return cluster


def published_tokens(metric: str, row: dict[str, Any]) -> float:
    """The row's published figure as tokens per second per GPU."""
    if metric == "tokens_per_gpu":
        return float(row["published"])
    if metric == "seconds_per_iteration":
        return row["global_batch"] * row["seq_len"] / (row["published"] * row["gpus"])
    if metric == "tflops_megatron":
        return row["published"] * 1e12 / megatron_flops_per_token(row["n_layer"], row["d_model"], row["seq_len"], row["vocab_size"])
    raise BehemothError(f"published metric {metric!r} is unknown", f"use one of {', '.join(METRICS)}")


def load_sources(folder: Path = PUBLISHED_DIR) -> list[dict[str, Any]]:
    """Every source file in `folder`, its rows filled from the file's defaults."""
    sources = []
    for path in sorted(folder.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        data["file"] = path.name
        data["rows"] = [{**data.get("defaults", {}), **row} for row in data["rows"]]
        sources.append(data)
    if not sources:
        raise BehemothError(f"no published rows in {folder}", "add benchmarks/published/*.yaml")
    return sources


def price_row(source: dict[str, Any], row: dict[str, Any], device: dict[str, Any] | None = None) -> PublishedRow:
    """One row priced by the planner's one pricing function (the simulator for a pipeline)."""
    from behemoth.config import load_config

    work = Workload.of(load_config(None, config_options(row)))
    work = replace(work, op_checkpointing=row["recompute"] == "op", p2p_inline=row.get("p2p_inline", "none"), p2p_split=row.get("p2p_split", False))
    lay = row_layout(row)
    lay = lay.but(boundaries=planned_bounds(work, lay))
    cost = price(work, lay, source_cluster(source, row["gpus"], device), exact=True, every_rank=False)
    predicted = cost.tokens_per_s / row["gpus"]
    described = lay.describe() + (" rc-op" if work.op_checkpointing else "")
    return PublishedRow(source["source"], row["name"], row.get("where", ""), described, published_tokens(source["metric"], row), predicted, cost)


def validate(
    folder: Path = PUBLISHED_DIR, names: set[str] | None = None, files: set[str] | None = None, device: dict[str, Any] | None = None
) -> list[PublishedRow]:
    """Every published row (or those `names`, or those of the source `files`), priced (`device`: fields set on top)."""
    return [
        price_row(src, row, device)
        for src in load_sources(folder)
        if files is None or src["file"] in files
        for row in src["rows"]
        if names is None or row["name"] in names
    ]


FIT_FILES = frozenset({"mpt-a100-80gb.yaml"})  # the rows the a100-80gb preset's sustained clock is fitted to
CLOCK_BRACKET = (0.6, 1.0)  # a sustained clock is searched between these shares of the rated one
CLOCK_TOLERANCE = 0.002


def fit_sustained_clock(files: set[str] | frozenset[str] = FIT_FILES, folder: Path = PUBLISHED_DIR) -> float:
    """The device's `sustained_clock` at which the rows of the source `files` are predicted, on geometric mean, at their
    published throughput (the log ratios' mean zero): predicted throughput rises with the clock, so a bisection finds it.
    The one number fitted to published runs; the rows of every other source stay held out."""
    lo, hi = CLOCK_BRACKET
    while hi - lo > CLOCK_TOLERANCE:
        mid = (lo + hi) / 2
        rows = validate(folder, files=set(files), device={"sustained_clock": mid})
        lo, hi = (mid, hi) if statistics.fmean(math.log(r.ratio) for r in rows) < 0 else (lo, mid)
    return round((lo + hi) / 2, 3)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation (average ranks for ties); nan for fewer than three pairs."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    if len(xs) < 3:
        return math.nan
    return statistics.correlation(ranks(xs), ranks(ys))


def comparisons(folder: Path = PUBLISHED_DIR, rows: list[PublishedRow] | None = None) -> list[tuple[str, str, str]]:
    """(source, published winner, predicted winner) of every source that compares layouts of one model (`compare:`)."""
    rows = validate(folder) if rows is None else rows
    by_name = {r.name: r for r in rows}
    out = []
    for src in load_sources(folder):
        group = [by_name[n] for n in src.get("compare", []) if n in by_name]
        if len(group) > 1:
            out.append((src["source"], max(group, key=lambda r: r.published).name, max(group, key=lambda r: r.predicted).name))
    return out
