"""`behemoth plan`, `behemoth estimate` on paper and `behemoth calibrate`, as a user runs them."""

from __future__ import annotations

import re
from dataclasses import replace

from behemoth.cli import main
from behemoth.config import load_config
from behemoth.planner.cluster import load_cluster
from behemoth.planner.feasibility import problems
from behemoth.planner.layout import Layout

GPT_7B = [
    "model.n_layer=36",
    "model.d_model=4096",
    "model.n_head=32",
    "model.vocab_size=51200",
    "model.context=2048",
    "train.seq_len=2048",
    "train.global_batch=512",
    "train.precision=bf16",
]
GPT_1T = [
    "model.n_layer=128",
    "model.d_model=25600",
    "model.n_head=160",
    "model.vocab_size=51200",
    "model.context=2048",
    "train.global_batch=3072",
    "train.precision=bf16",
]


def test_plan_prints_a_ranked_explained_table_and_writes_the_plan(tmp_path, capsys):
    out_file = tmp_path / "plan.yaml"
    assert main(["plan", "--cluster", "a100-80gb", "--world", "128", "--out", str(out_file), *GPT_7B]) == 0
    out = capsys.readouterr().out
    assert "36 layers x d_model 4096, 32 heads" in out and "128 devices of a100-80gb" in out
    assert re.search(r"#\s+plan\s+GiB/rank\s+step\s+tokens/s\s+MFU\s+HFU\s+binding constraint", out)
    rows = re.findall(r"^\s*(\d+)  (dp=\d+ (?:cp=\d+\(\w+\) )?tp=\d+ pp=\d+ zero=\d+.*?)\s{2,}", out, re.M)
    assert [int(r[0]) for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 2
    assert re.search(r"beats .* by [\d.]+% \(.* against .* per step\)", out) and "what binds it:" in out
    cfg = load_config(out_file)  # the same YAML a user writes: it loads, runs on 128 devices, and is the first plan
    assert problems(cfg, 128) == []
    assert Layout.of_config(cfg, 128).describe().split(" rc")[0] == rows[0][1].strip().split(" rc")[0]


def test_pinned_options_are_not_searched(capsys):
    assert main(["plan", "--cluster", "a100-80gb", "--world", "64", "parallel.tp=4", "parallel.schedule=zb-h1", *GPT_7B]) == 0
    rows = re.findall(r"^\s*\d+  (dp=\d+ tp=(\d+) pp=(\d+) zero=\d+( sp)?( \S+)?)", capsys.readouterr().out, re.M)
    assert rows and all(tp == "4" for _, tp, _, _, _ in rows)
    assert all(pp == "1" or "zb-h1" in plan for plan, _, pp, _, _ in rows)


def test_a_model_that_fits_nowhere_says_by_how_much_and_what_would(capsys):
    # offload pinned to the device (the user placed it): on the devices alone nothing fits, with disk offload a plan would
    assert main(["plan", "--cluster", "a100-80gb", "--world", "64", *GPT_1T, "offload.params=device", "offload.optimizer=device"]) == 3
    out = capsys.readouterr().out
    found = re.search(
        r"No plan fits 64 devices of ([\d.]+) GiB usable: the lightest, .*, needs ([\d.]+) GiB on pp rank \d+, "
        r"([\d.]+) GiB \((\d+)%\) more",
        out,
    )
    assert found, out
    usable, need, over = (float(found.group(i)) for i in (1, 2, 3))
    assert abs(need - usable - over) < 0.2
    more = re.search(r"What would: (\d+) devices", out)
    assert more and int(more.group(1)) > 64 and int(more.group(1)) % 64 == 0
    assert "Offload was searched" not in out and "does not try offload" not in out  # the user pinned the placement


def test_the_advice_says_whether_offload_was_searched():
    """Nothing fits even offloaded (64 devices of 0.5 GB, 8 GB of host memory per node): the advice says the search tried
    offload and does not tell the user to; with the placement pinned to the devices and the optimizer state larger
    than the shortfall, it names the option that would make room."""
    from behemoth.planner.explain import unfit_advice
    from behemoth.planner.layout import Offload, Workload
    from behemoth.planner.search import Space, search

    cfg = load_config(None, GPT_7B)
    a100 = load_cluster("a100-80gb")
    small = a100.model_copy(
        update={"device": a100.device.model_copy(update={"memory_gb": 0.5}), "host": a100.host.model_copy(update={"memory_gb": 8.0})}
    )
    result = search(Workload.of(cfg), small, 64, cfg=cfg, exact=0)
    assert result.ranked == [] and any(c.layout.offload.enabled for c in result.unfit)
    text = unfit_advice(result.unfit, small.with_nodes(64), 64, lambda w: None)
    assert "Offload was searched too" in text and "offload.optimizer=host" not in text, text
    pinned = search(Workload.of(cfg), small, 64, Space(offload=(Offload(),)), cfg=cfg, exact=0).unfit[0]
    short = replace(pinned, limit=pinned.peak_memory - pinned.busiest.optimizer / 2)  # short by half its optimizer state
    text = unfit_advice([short], small.with_nodes(64), 64, lambda w: None, offload_searched=False)
    assert "offload.optimizer=host" in text and "Offload was searched" not in text, text


def test_estimate_sizes_a_layout_on_paper(capsys):
    """1,024 processes on paper, no process started: the resolved shape in the header, each pipeline rank's memory."""
    from behemoth.cli.estimate import estimate_main

    assert (
        estimate_main(
            [
                "--world",
                "1024",
                "model.n_layer=80",
                "model.d_model=12288",
                "model.n_head=96",
                "model.vocab_size=51200",
                "model.context=2048",
                "train.global_batch=1024",
                "train.micro_batch=1",
                "parallel.tp=8",
                "parallel.pp=8",
                "parallel.zero_stage=1",
                "parallel.sequence_parallel=true",
                "train.precision=bf16",
                "parallel.param_dtype=bf16",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "gpt 80 layers x d_model 12288, 96 heads" in out and "dp=16 x tp=8 x pp=8, ZeRO-1, sequence parallel" in out
    ranks = re.findall(r"^\s+(\d+)\s+([\d.]+) GiB \(([\d.]+) GB\)", out, re.M)
    assert [int(r[0]) for r in ranks] == list(range(8))
    for _, gib, gb in ranks:  # model states of a 145.6B model's 1/64 share, ZeRO-1 over 16: 2 + 2 + 12/16 bytes per parameter
        assert 9 < float(gib) < 13 and abs(float(gb) / float(gib) - 1.0737) < 0.01


def test_calibrate_writes_a_cluster_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("BEHEMOTH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "here.yaml"
    assert main(["calibrate", "--nproc", "2", "--out", str(out)]) == 0
    spec = load_cluster(out)
    assert spec.kind == "calibrated" and spec.world == 2 and spec.device.memory_bandwidth_gbs > 0
    assert set(spec.intra_node.ops) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
    assert all(lat > 0 and bw > 0 for lat, bw in spec.intra_node.ops.values())
    assert spec.device.matmul_tflops["fp32"] and (tmp_path / "cache" / "cluster-local-2.yaml").exists()
    assert spec.device.adamw is not None and spec.device.adamw.ns_per_element > 0  # AdamW's measured price per element
    printed = capsys.readouterr().out
    assert "all_reduce" in printed and "ns per parameter element" in printed and "slower while one runs beside it" in printed
    assert 0 <= spec.device.overlap_slowdown <= 0.9  # measured on this host (its magnitude depends on the load)
    assert "train.gemm=auto" in spec.source  # the products were timed by the library training multiplies with


def measured_here(slowdown: float) -> dict:
    """Rank 0's measurements as `calibrate_worker` returns them (two CPU processes), with `slowdown` as measured."""
    curve = [(2**12, 1e-4), (2**20, 1e-3), (2**23, 8e-3)]
    return {
        "world": 2,
        "device": "cpu",
        "matmul": {"fp32": [(128, 0.02), (256, 0.03)]},
        "collectives": {"all_reduce": curve, "all_gather": curve, "reduce_scatter": curve, "all_to_all": curve, "p2p": curve},
        "memory_bandwidth_gbs": 5.0,
        "comm_overlap": 0.5,
        "overlap_slowdown": slowdown,
        "op_overhead_us": 10.0,
        "flash_efficiency": 0.5,
        "block_efficiency": 0.8,
        "disk_bandwidth_gbs": 0.5,
        "device_name": "CPU process",
        "device_memory": None,
        "cores": 2,
    }


def test_the_measured_overlap_slowdown_is_stored_read_back_and_priced(tmp_path, capsys):
    """`calibrate` stores the slowdown it measured in the cluster file; `plan` reads it back, says it, and prices a ZeRO-3
    plan's hidden traffic with it (contention = slowdown x the hidden seconds: zero without it)."""
    from behemoth.planner.calibrate import spec_from
    from behemoth.planner.cost import price
    from behemoth.planner.layout import Workload

    path = tmp_path / "here.yaml"
    path.write_text(spec_from(measured_here(0.25)).to_yaml())
    spec = load_cluster(path)
    assert spec.kind == "calibrated" and spec.device.overlap_slowdown == 0.25
    cfg = load_config(None, ["model=gpt-1m", "train.global_batch=8", "train.seq_len=64"])
    lay = Layout(dp=2, zero=3, micro_batch=4, microbatches=1)
    slowed = price(Workload.of(cfg), lay, spec).time
    plain = price(Workload.of(cfg), lay, spec.model_copy(update={"device": spec.device.model_copy(update={"overlap_slowdown": 0.0})})).time
    assert plain.dp_contention == 0 < slowed.dp_contention and slowed.dp_comm > plain.dp_comm
    assert main(["plan", "--cluster", str(path), "--world", "2", "model=gpt-1m", "train.global_batch=8", "train.seq_len=64"]) == 0
    assert "computation running 25% slower while it does (measured by behemoth calibrate" in capsys.readouterr().out
