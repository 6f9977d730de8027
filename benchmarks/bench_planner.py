"""Does the planner choose well? Predicted against measured step time and memory, and plans at scale on paper.

(a) Here: for three GPT models (about 1M, 6M and 20M parameters) on 2 and 4 local processes, every feasible plan of a
    bounded space (20-60 per case; --quick: fewer) runs a few steps; each plan's predicted step time and peak memory
    per rank stand beside the measured ones, with the Spearman rank correlation of the step times, the measured time
    of the plan the planner chose against the best measured, and the planning time. Then the chosen plan and the
    sweep's three fastest are measured again in alternating rounds (--rounds, default 3) and the ratio that counts is
    of their medians: one measurement per plan makes the sweep's fastest the luckiest of many draws. The cluster is
    this machine as `behemoth calibrate` measures it (run first, or the in-process probe is used).
(b) On paper: the GPT shapes of Megatron-LM's scaling table (Narayanan et al. 2021, Table 1: 1.7B to 1T parameters
    on 32 to 3,072 A100 GPUs, global batch 512-3,072, sequence 2,048) planned for the A100-80GB preset: the chosen
    plan, predicted memory per GPU, MFU and HFU, and the planning time, beside the layout and the hardware FLOP
    utilization Megatron-LM reports (its FLOP count includes recomputation, so it compares with HFU); then each
    chosen plan's step by part (compute, exposed tp / cp / dp traffic and dp's contention, bubble, optimizer).

    python benchmarks/bench_planner.py --quick          # a minute or two
    python benchmarks/bench_planner.py                  # the full run (about 30 minutes on 2 cores)
    python benchmarks/bench_planner.py --part b         # the on-paper table only (seconds)
(c) Published: every run recorded in benchmarks/published/*.yaml (a paper's or project's layout and measured
    throughput, with its source and table), priced by the planner's one pricing function on the source's hardware,
    predicted beside published tokens per second per GPU, the ratio per row, the Spearman rank correlation, and the
    winner where a source compares layouts of one model. One number is fitted to published rows: the A100 preset's
    `sustained_clock`, to the MosaicML A100 80GB table's rows alone (`published.fit_sustained_clock`, re-run here);
    every other source's rows are held out and summarized apart, and the same fit on Megatron-LM's rows alone is
    printed beside it (how far one source's value is from another's).

    python benchmarks/bench_planner.py --part published [--markdown FILE]   # about a minute
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ratios import ratio, write_rows

ROWS: list = []  # the chosen plans against the best measured, for `behemoth bench` (--json)
FINALISTS = 3  # the sweep's fastest plans re-measured beside the chosen one (`confirm`)

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {  # name: (options, ~parameters)
    "gpt-1m": ["model=gpt-1m"],
    "gpt-6m": ["model=gpt-1m", "model.n_layer=6", "model.d_model=256", "model.n_head=8"],
    "gpt-20m": ["model=gpt-20m", "model.context=128"],
}
BATCH = ["train.global_batch=16", "train.seq_len=128"]
MEGATRON = [  # Narayanan et al. 2021, Table 1: heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU, % of peak
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 0.44),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 0.44),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 0.46),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 0.43),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 0.44),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 0.45),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 0.47),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 0.50),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 0.52),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 0.52),
]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation (average ranks for ties): the planner's own (behemoth/planner/published.py)."""
    from behemoth.planner.published import spearman as rank_correlation

    return rank_correlation(xs, ys)


def candidate_plans(cfg, world: int, cluster, limit: int, seed: int = 0):
    """Every fitting plan of the space the search explores (problems() agreeing), sampled down to `limit`, and the
    search's own choice (always kept), with the planning time."""
    from behemoth.planner.layout import Workload
    from behemoth.planner.search import Space, enumerate_layouts, fit_layout, refusals, search

    work = Workload.of(cfg)
    t0 = time.perf_counter()
    chosen = search(work, cluster, world, Space(), cfg=cfg, top=1).ranked[0]
    planning = time.perf_counter() - t0
    space = Space(micro_batch=(1, 2, 4, 8), chunks=(2,))
    costs = [fit_layout(work, lay, cluster, space) for lay in enumerate_layouts(work, world, space, cluster)]
    ok = [c for c in costs if c.fits and not refusals(cfg, c.layout, world)]
    random.Random(seed).shuffle(ok)
    picked = {c.layout.but(boundaries=c.bounds): c for c in ok[:limit]}
    picked[chosen.layout.but(boundaries=chosen.bounds)] = chosen
    return list(picked.values()), chosen, planning


def measure_case(name: str, world: int, limit: int, steps: int, rounds: int = 0) -> dict:
    from behemoth.config import load_config
    from behemoth.faults.ranks import run_ranks
    from behemoth.planner.calibrate import local_cluster
    from behemoth.planner.cost import price
    from behemoth.planner.layout import Workload
    from behemoth.profiler.measure import measure_plan

    run_dir = tempfile.mkdtemp(prefix="bench-planner-")
    cfg = load_config(None, MODELS[name] + BATCH + ["run.progress=false", "run.timeout_s=120", f"run.dir={run_dir}"])
    cluster = local_cluster(world).with_nodes(world)
    plans, chosen, planning = candidate_plans(cfg, world, cluster, limit)
    work = Workload.of(cfg)
    rows = []

    def measure(plan_cfg) -> tuple[float, float]:
        ranks = run_ranks(world, measure_plan, plan_cfg.model_dump(mode="json"), steps, 1, timeout=600)
        return max(r["step_time"] for r in ranks), max(r["peak"] for r in ranks)

    for cost in plans:
        lay = cost.layout.but(boundaries=cost.bounds)
        exact = price(work, lay, cluster, exact=True)
        plan_cfg = cfg.model_copy(update={"parallel": lay.to_plan(cfg.parallel)})
        measured_time, measured_peak = measure(plan_cfg)
        rows.append(
            {
                "plan": lay.describe(),
                "cfg": plan_cfg,
                "pred_time": exact.step_seconds,
                "time": measured_time,
                "pred_mem": exact.peak_memory,
                "mem": measured_peak,
                "chosen": lay.describe() == chosen.layout.describe(),
            }
        )
        print(
            f"  {name} x{world}: {lay.describe():48s} predicted {exact.step_seconds * 1e3:8.1f} ms {exact.peak_memory / 2**20:8.1f} MiB"
            f"   measured {measured_time * 1e3:8.1f} ms {measured_peak / 2**20:8.1f} MiB",
            flush=True,
        )
    finalists = confirm(rows, measure, rounds, name, world)
    for r in rows:
        del r["cfg"]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"model": name, "world": world, "rows": rows, "finalists": finalists, "planning": planning, "params": work.census.psi}


def confirm(rows: list[dict], measure, rounds: int, name: str, world: int) -> list[dict]:
    """Re-measure the chosen plan and the `FINALISTS` fastest of the sweep in `rounds` alternating rounds (each round
    one measurement of each, the order rotated), and keep each one's median: the sweep measures each plan once, so
    its fastest is the least of many noisy draws (biased low) and a drift of the machine's load between two plans'
    turns reads as a difference between the plans. Alternating puts the finalists under the same conditions."""
    if rounds <= 0:
        return []
    fastest = sorted(rows, key=lambda r: r["time"])[:FINALISTS]
    finalists = fastest + [r for r in rows if r["chosen"] and r not in fastest]
    times: dict[int, list[float]] = {i: [] for i in range(len(finalists))}
    for k in range(rounds):
        order = list(range(len(finalists)))
        order = order[k % len(order) :] + order[: k % len(order)]
        for i in order:
            times[i].append(measure(finalists[i]["cfg"])[0])
    out = []
    for i, r in enumerate(finalists):
        out.append({"plan": r["plan"], "chosen": r["chosen"], "sweep": r["time"], "times": times[i], "time": statistics.median(times[i])})
        print(f"  {name} x{world}: confirm {r['plan']:48s} " + " ".join(f"{t * 1e3:7.1f}" for t in times[i]) + " ms", flush=True)
    return out


def report_a(cases: list[dict]) -> None:
    print("\n(a) predicted vs measured, per case (time: the slowest rank's median step; memory: the busiest rank's peak)")
    confirmed = any(c["finalists"] for c in cases)
    head = f"{'model':<9}{'procs':>6}{'plans':>6}{'Spearman':>10}{'mem err':>9}{'chosen':>10}{'best':>10}{'chosen/best':>12}"
    if confirmed:
        head += f"{'confirmed':>11}{'best':>10}{'chosen/best':>12}"
    print(head + f"{'planning':>10}")
    for c in cases:
        rows = c["rows"]
        rho = spearman([r["pred_time"] for r in rows], [r["time"] for r in rows])
        mem_err = statistics.median(abs(r["pred_mem"] / r["mem"] - 1) for r in rows)
        best = min(r["time"] for r in rows)
        chosen = next(r["time"] for r in rows if r["chosen"])
        line = (
            f"{c['model']:<9}{c['world']:>6}{len(rows):>6}{rho:>10.2f}{mem_err:>9.1%}{chosen * 1e3:>8.1f}ms{best * 1e3:>8.1f}ms{chosen / best:>12.2f}"
        )
        if c["finalists"]:  # the ratio that counts: the finalists' medians over alternating rounds
            best = min(r["time"] for r in c["finalists"])
            chosen = next(r["time"] for r in c["finalists"] if r["chosen"])
            line += f"{chosen * 1e3:>9.1f}ms{best * 1e3:>8.1f}ms{chosen / best:>12.2f}"
        elif confirmed:
            line += f"{'':>33}"
        print(line + f"{c['planning']:>9.2f}s")
        ROWS.append(
            ratio(
                "planner",
                f"{c['model']}, {c['world']} processes, {len(rows)} plans",
                "best measured plan",
                "step time of the chosen plan",
                chosen,
                best,
                higher_is_better=False,
            )
        )
    if confirmed:
        print(
            f"confirmed: the chosen plan and the sweep's {FINALISTS} fastest re-measured in alternating rounds, the median "
            "of each (--rounds); the sweep's columns measure each plan once"
        )


def part_b() -> None:
    from behemoth.config import load_config
    from behemoth.planner.cluster import load_cluster
    from behemoth.planner.layout import Workload
    from behemoth.planner.search import Space, search

    cluster = load_cluster("a100-80gb")
    print("\n(b) on paper: Megatron-LM's GPT shapes on the A100-80GB preset, sequence 2048, bf16 (parameters bf16 under ZeRO)")
    parts = []
    print(f"{'model':>8}{'GPUs':>6}{'batch':>6}  {'chosen plan':<46}{'GiB/GPU':>8}{'MFU':>7}{'HFU':>7}{'plan s':>8}   Megatron-LM (tp, pp, HFU)")
    for name, heads, hidden, layers, tp, pp, gpus, batch, _tflops, frac in MEGATRON:
        cfg = load_config(
            None,
            [
                f"model.n_layer={layers}",
                f"model.d_model={hidden}",
                f"model.n_head={heads}",
                "model.vocab_size=51200",
                "model.context=2048",
                "train.seq_len=2048",
                f"train.global_batch={batch}",
                "train.precision=bf16",
                "parallel.param_dtype=bf16",
                "parallel.zero_stage=1",
            ],
        )  # (a stage >= 1 makes bf16 valid; all are searched)
        t0 = time.perf_counter()
        result = search(Workload.of(cfg), cluster, gpus, Space(), cfg=cfg, top=1)
        seconds = time.perf_counter() - t0
        best = result.ranked[0] if result.ranked else None
        plan = best.layout.describe() if best else "nothing fits"
        mem = f"{best.peak_memory / 2**30:8.1f}" if best else f"{'-':>8}"
        util = f"{best.mfu:>7.1%}{best.hfu:>7.1%}" if best else f"{'-':>7}{'-':>7}"
        print(f"{name:>8}{gpus:>6}{batch:>6}  {plan:<46}{mem}{util}{seconds:>8.2f}   tp={tp} pp={pp} {frac:.0%}")
        if best:
            parts.append((name, best.time))
    print(
        "\n    where each chosen plan's step goes (seconds): compute (the passes less their bubble and the collectives inside"
        " them), exposed comm by kind (dp: ZeRO/data-parallel, of it the compute lost to contention), bubble, optimizer"
    )
    print(f"{'model':>8}{'step':>8}{'compute':>9}{'tp':>7}{'cp':>7}{'dp':>7}{'(cont.)':>8}{'dp link':>8}{'ep':>6}{'bubble':>8}{'optim':>7}")
    for name, t in parts:
        compute = t.passes - t.bubble - t.tp_comm - t.cp_comm
        print(
            f"{name:>8}{t.total:>8.2f}{compute:>9.2f}{t.tp_comm:>7.2f}{t.cp_comm:>7.2f}{t.dp_comm:>7.2f}{t.dp_contention:>8.2f}"
            f"{t.dp_traffic:>8.2f}{t.ep_comm:>6.2f}{t.bubble:>8.2f}{t.optimizer:>7.2f}"
        )


def row_summary(label: str, rows: list) -> str:
    """Rows, sources, Spearman, how many within 10% and the median |ratio - 1| of `rows`."""
    rho = spearman([r.published for r in rows], [r.predicted for r in rows])
    within = sum(abs(r.ratio - 1) <= 0.10 for r in rows)
    median = statistics.median(abs(r.ratio - 1) for r in rows)
    return (
        f"{label}: {len(rows)} rows from {len({r.source for r in rows})} sources; Spearman {rho:.3f}; {within} of {len(rows)}"
        f" within 10%; median |ratio - 1| {median:.1%}"
    )


def part_published(markdown: str | None = None) -> None:
    """(c): predicted against published per-GPU throughput, one row per published run."""
    from behemoth.planner.cluster import load_cluster
    from behemoth.planner.published import FIT_FILES, comparisons, fit_sustained_clock, validate

    t0 = time.perf_counter()
    rows = validate()
    seconds = time.perf_counter() - t0
    fitted = {r.name for r in validate(files=set(FIT_FILES))}
    print("\n(c) published runs priced by the planner (tokens/s per GPU; predicted / published; fit: the rows the clock is fitted to)")
    header = f"{'run':<24}{'layout (as published)':<44}{'published':>10}{'predicted':>10}{'ratio':>7}{'MFU':>6}{'fits':>6}{'fit':>5}  source"
    print(header)
    lines = []
    for r in rows:
        fits, fit = "yes" if r.cost.fits else "no", "fit" if r.name in fitted else "held"
        print(
            f"{r.name:<24}{r.layout:<44}{r.published:>10.1f}{r.predicted:>10.1f}{r.ratio:>7.2f}{r.cost.mfu:>6.0%}{fits:>6}{fit:>5}"
            f"  {r.source}, {r.where}"
        )
        lines.append(
            f"| {r.name} | `{r.layout}` | {r.published:.1f} | {r.predicted:.1f} | {r.ratio:.2f} | {r.cost.mfu:.0%} | {fits} | {fit} |"
            f" {r.source}, {r.where} |"
        )
    shipped = load_cluster("a100-80gb").device.sustained_clock
    summary = [
        row_summary("all", rows) + f"; priced in {seconds:.1f} s",
        row_summary("held out (not fitted)", [r for r in rows if r.name not in fitted]),
        f"sustained clock: {shipped} in the a100-80gb preset; fitted to {', '.join(sorted(FIT_FILES))} now: {fit_sustained_clock()};"
        f" the same fit to megatron-2021.yaml alone: {fit_sustained_clock({'megatron-2021.yaml'})}",
    ]
    for source, published, predicted in comparisons(rows=rows):
        summary.append(f"{source}: published winner {published}, predicted winner {predicted} ({'same' if published == predicted else 'DIFFERENT'})")
    print("\n".join(summary))
    if markdown:
        table = ["| run | layout | published | predicted | ratio | MFU | fits | fit | source |", "|---|---|---:|---:|---:|---:|---|---|---|"]
        Path(markdown).write_text("\n".join(table + lines + [""] + [f"- {line}" for line in summary]) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two models on 2 processes, a few plans each")
    parser.add_argument("--procs", default=None, help="process counts, e.g. 2,4 (default: 2 with --quick, else 2 and 4)")
    parser.add_argument("--part", choices=["a", "here", "b", "both", "published"], default="both", help="here: (a); published: (c)")
    parser.add_argument("--models", default=None, help=f"with --part here: a comma list of {', '.join(MODELS)} (default all)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="with --part here: alternating rounds re-measuring the finalists (default 3; --quick: 0)"
    )
    parser.add_argument("--markdown", metavar="FILE", help="with --part published: also write its table as Markdown")
    parser.add_argument("--json", metavar="FILE", help="also write the ratio rows to FILE (for `behemoth bench`)")
    args = parser.parse_args()
    if args.part == "published":
        part_published(args.markdown)
    if args.part in ("a", "here", "both"):
        procs = [int(p) for p in (args.procs or "2").split(",")]
        models = args.models.split(",") if args.models else list(MODELS)
        unknown = [m for m in models if m not in MODELS]
        if unknown:
            parser.error(f"unknown model(s) {', '.join(unknown)}: pick from {', '.join(MODELS)}")
        worlds = procs if args.procs else (2, 4)
        plan = [(m, w, 6) for w in procs for m in ("gpt-1m", "gpt-6m")] if args.quick else [(m, w, 30) for m in models for w in worlds]
        rounds = args.rounds if args.rounds is not None else (0 if args.quick else 3)
        cases = [measure_case(m, w, limit, steps=2 if args.quick else 3, rounds=rounds) for m, w, limit in plan]
        report_a(cases)
    if args.part in ("b", "both"):
        part_b()
    write_rows(args.json, ROWS)


if __name__ == "__main__":
    main()
