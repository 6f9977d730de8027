"""The tables and `behemoth bench` rows of bench_pipeline.py: its measurements as benchmarks/README.md shows them."""

from __future__ import annotations

V_PART = ["1f1b", "1f1b+recompute", "1f1b-scp", "zb-h1", "zbv", "dualpipev"]  # behemoth's rows of `--part v`
TORCH_V = ["1f1b", "zbv", "dualpipev"]  # torch.distributed.pipelining's rows of `--part v`
COMPILED = ["gpipe+compile", "1f1b+compile"]  # `--part compiled`: both runtimes' compiled paths


def format_v_table(best: dict[tuple[int, str, str], dict], worlds: list[int], command: str) -> str:
    lines = [
        f"`{command}` — the same GPT and micro-batching as above; behemoth's schedule against its own 1F1B, and against "
        "torch.distributed.pipelining's own schedule of the same name on the same stages (gloo, CPU). The V schedules cut "
        "the model into 2p stages. Bubbles: measured from executor timestamps, simulated from the same step's median pass times. "
        "tok/s from the fastest step of all rounds; CPU s/step (median step of the least-work round, summed over ranks) is "
        "what a loaded machine disturbs least.",
        "",
        "| p | schedule | tok/s | vs 1f1b | CPU s/step, all ranks | measured bubble | simulated | closed form (uniform) "
        "| peak stash MB per rank | torch's tok/s | torch's CPU s/step | behemoth / torch tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in worlds:
        base = best.get((w, "behemoth", "1f1b"), {}).get("tokens_per_s")
        for s in V_PART:
            r, peer = best.get((w, "behemoth", s), {}), best.get((w, "torch", s)) if s in TORCH_V else None
            if "tokens_per_s" not in r:
                lines.append(f"| {w} | {s} | failed: {r.get('error', 'not run')} | | | | | | | | | |")
                continue
            theirs = "— | —" if peer is None else f"failed: {peer['error']} | —" if "error" in peer else None
            theirs = theirs or f"{peer['tokens_per_s']:.0f} | {peer['cpu_s']:.2f}"
            ratio = f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}" if peer and "tokens_per_s" in peer else "—"
            stash = " / ".join(f"{x:.1f}" for x in r["stash"])
            lines.append(
                f"| {w} | {s} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f} | {r['cpu_s']:.2f} "
                f"| {r['bubble']:.3f} | {r['simulated']:.3f} "
                f"| {r['closed_form']:.3f} | {stash} | {theirs} | {ratio} |"
            )
    return "\n".join(lines)


def format_compiled_table(best: dict[tuple[int, str, str], dict], worlds: list[int], command: str) -> str:
    """`--part compiled`: behemoth with train.compile=true against torch.distributed.pipelining with each block compiled."""
    lines = [
        f"`{command}` — the same GPT and micro-batching as above, every block compiled on both sides (behemoth "
        "`train.compile=true`; torch.distributed.pipelining's stages built from blocks `compile()`d in place); compilation "
        "falls in the untimed warm-up steps. tok/s from the fastest step of all rounds; CPU s/step: the median step of the "
        "least-work round, summed over ranks.",
        "",
        "| p | schedule | behemoth tok/s | torch tok/s | ratio | CPU s/step behemoth / torch | CPU ratio torch / behemoth |",
        "|---|---|---|---|---|---|---|",
    ]
    for w in worlds:
        for s in COMPILED:
            ours, theirs = best.get((w, "behemoth", s), {}), best.get((w, "torch", s), {})
            if "tokens_per_s" not in ours or "tokens_per_s" not in theirs:
                lines.append(f"| {w} | {s} | {ours.get('error', '')} | {theirs.get('error', '')} | — | — | — |")
                continue
            lines.append(
                f"| {w} | {s.partition('+')[0]} | {ours['tokens_per_s']:.0f} | {theirs['tokens_per_s']:.0f} "
                f"| {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f} | {ours['cpu_s']:.2f} / {theirs['cpu_s']:.2f} "
                f"| {theirs['cpu_s'] / ours['cpu_s']:.2f} |"
            )
    return "\n".join(lines)


def format_tables(throughput: list[dict], bubbles: list[dict], command: str) -> str:
    lines = [
        f"`{command}` — GPT with 8 blocks, d_model 128, 4 heads, 128 tokens, 16 sequences per step in 8 micro-batches "
        "of 2, float32, one thread per process; tokens/s of the fastest step over all rounds, CPU seconds of the "
        "least-work round's median step summed over ranks.",
        "",
        "| processes | schedule | behemoth tok/s | torch.distributed.pipelining tok/s | ratio | DeepSpeed PipelineModule tok/s | ratio "
        "| CPU s/step, all ranks: behemoth / torch / DeepSpeed | CPU ratio torch / behemoth | DeepSpeed / behemoth |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in throughput:
        ds = f"{r['deepspeed']:.0f} | {r['ours'] / r['deepspeed']:.2f}" if r["deepspeed"] else "— | —"
        cpu = f"{r['ours_cpu']:.2f} / {r['torch_cpu']:.2f} / " + (f"{r['deepspeed_cpu']:.2f}" if r["deepspeed"] else "—")
        ds_cpu = f"{r['deepspeed_cpu'] / r['ours_cpu']:.2f}" if r["deepspeed"] else "—"
        lines.append(
            f"| {r['world']} | {r['schedule']} | {r['ours']:.0f} | {r['torch']:.0f} | {r['ours'] / r['torch']:.2f} | {ds} "
            f"| {cpu} | {r['torch_cpu'] / r['ours_cpu']:.2f} | {ds_cpu} |"
        )
    lines += [
        "",
        "| processes | schedule | m | tok/s | measured bubble | simulated (median pass times) | measured - simulated "
        "| replayed (each pass's own time) | closed form (uniform) | p2p ms | peak stash MB per rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in bubbles:
        stash = " / ".join(f"{x:.1f}" for x in r["stash"])
        lines.append(
            f"| {r['world']} | {r['schedule']} | {r['m']} | {r['tokens_per_s']:.0f} | {r['bubble']:.3f} | {r['simulated']:.3f} "
            f"| {r['bubble'] - r['simulated']:+.3f} | {r['replayed']:.3f} | {r['closed_form']:.3f} | {r['p2p_ms']:.3f} | {stash} |"
        )
    return "\n".join(lines)


def ratio_rows(throughput: list[dict], bubbles: list[dict]) -> list[dict]:
    """`behemoth bench` rows: behemoth vs torch.distributed.pipelining and DeepSpeed, and every schedule vs 1F1B."""
    from ratios import ratio

    out = []
    for r in throughput:
        case = f"{r['schedule']}, p={r['world']}"
        for peer, name in (("torch", "torch.distributed.pipelining"), ("deepspeed", "DeepSpeed PipelineModule")):
            if r[peer]:
                out += [
                    ratio("pipeline", case, name, "tokens/s", r["ours"], r[peer]),
                    ratio("pipeline", case, name, "CPU s per step", r["ours_cpu"], r[f"{peer}_cpu"], higher_is_better=False),
                ]
    base = {b["world"]: b for b in bubbles if b["schedule"] == "1f1b"}
    for b in bubbles:
        if b["schedule"] != "1f1b":
            out.append(
                ratio(
                    "pipeline schedules",
                    f"{b['schedule']}, p={b['world']}",
                    "behemoth 1f1b",
                    "tokens/s",
                    b["tokens_per_s"],
                    base[b["world"]]["tokens_per_s"],
                )
            )
    return out


def v_ratio_rows(best: dict[tuple[int, str, str], dict]) -> list[dict]:
    """`--part v`'s rows: each schedule vs behemoth's 1F1B, and vs torch's schedule of the same name."""
    from ratios import failure, ratio

    out = []
    for (w, runtime, s), r in sorted(best.items()):
        base = best.get((w, "behemoth", "1f1b"), {})
        if runtime == "torch" and "error" in r:
            out.append(failure("pipeline schedules", f"torch.distributed.pipelining {s}", r["error"]))
        elif runtime == "behemoth" and "tokens_per_s" in r and s != "1f1b" and "tokens_per_s" in base:
            out.append(ratio("pipeline schedules", f"{s}, p={w}", "behemoth 1f1b", "tokens/s", r["tokens_per_s"], base["tokens_per_s"]))
        peer = best.get((w, "torch", s), {})
        if runtime == "behemoth" and "tokens_per_s" in r and "tokens_per_s" in peer:
            out.append(ratio("pipeline", f"{s}, p={w}", "torch.distributed.pipelining", "tokens/s", r["tokens_per_s"], peer["tokens_per_s"]))
    return out
