"""What to rent: for each instance type of a catalog and each instance count, the planner's best plan for the model,
its predicted time and money to train T tokens; the cheapest option that meets a deadline (or the fastest within a
budget), with the runner-up and why it lost.

An instance type is a cluster preset's device and host (planner/clusters/) with its own count of devices, intra-node
interconnect and network; `cluster_of` turns it and a count into the `ClusterSpec` the planner searches. For one
instance type and count, money and time are both proportional to the step time, so the planner's fastest plan is
also the cheapest there: the choice between options is only over (instance type, count), every count from 1 to the
type's `max_nodes`.

`behemoth profile --json F` measures a plan where the model's hardware figures can be checked against the device:
`Calibration` turns its measured and predicted components into factors (compute, communication, bubble, offload, and
the share of work the planner does not model) that rescale the predicted step of every plan on the instance types
whose preset the profile was predicted on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from behemoth.errors import BehemothError
from behemoth.planner.cluster import ClusterSpec, LinkSpec, load_cluster
from behemoth.planner.cost import PlanCost
from behemoth.planner.layout import Workload
from behemoth.planner.search import Space, search

CATALOG = Path(__file__).resolve().parents[1] / "planner" / "catalogs" / "instances.yaml"
NETWORK_EFFICIENCY = 0.88  # share of a network's line rate collectives reach (the presets' assumption)
NETWORK_LATENCY_US = 15.0
EVERY_LAYOUT = Space()


class Instance(BaseModel):
    """One instance type: devices (a preset's), interconnect, network and price per instance-hour."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    provider: str = ""
    preset: str = Field(..., description="cluster preset or file whose device and host figures the instance has")
    devices: int = Field(..., ge=1)
    interconnect_gbs: float = Field(..., gt=0, description="intra-node collective bandwidth per device, GB/s")
    network_gbit: float = Field(..., gt=0, description="network per instance, Gbit/s")
    price_per_hour: float = Field(..., gt=0, description="per instance-hour, USD")
    price_date: str = ""
    price_source: str = ""
    illustrative: bool = True
    max_nodes: int = Field(8, ge=1, description="most instances of this type to consider")


class Catalog(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    date: str = ""
    instances: list[Instance]


def load_catalog(path: str | Path | None = None) -> Catalog:
    """The shipped catalog, or a user's YAML file of the same shape."""
    file = Path(path).expanduser() if path else CATALOG
    if not file.is_file():
        raise BehemothError(f"--catalog {file} does not exist", f"pass a YAML file shaped like {CATALOG}")
    try:
        return Catalog.model_validate(yaml.safe_load(file.read_text()))
    except (yaml.YAMLError, ValidationError) as err:
        first = err.errors()[0] if isinstance(err, ValidationError) else None
        where = f" ({'.'.join(map(str, first['loc']))}: {first['msg']})" if first else ""
        raise BehemothError(f"catalog {file} is not a valid instance catalog{where}", f"see {CATALOG}") from None


def cluster_of(inst: Instance, nodes: int) -> ClusterSpec:
    """`nodes` instances of `inst` as the cluster the planner searches."""
    base = load_cluster(inst.preset)
    intra = LinkSpec(latency_us=base.intra_node.latency_us, bandwidth_gbs=inst.interconnect_gbs)
    network = LinkSpec(latency_us=NETWORK_LATENCY_US, bandwidth_gbs=inst.network_gbit / 8 * NETWORK_EFFICIENCY / inst.devices)
    return base.model_copy(update={"name": inst.name, "nodes": nodes, "devices_per_node": inst.devices, "intra_node": intra, "inter_node": network})


COMPUTE_ROWS = ("forward", "backward", "optimizer")
COMM_ROWS = ("comm_dp", "comm_tp", "comm_ep")
UNMODELLED_ROWS = ("data", "host")  # a checkpoint's stall depends on how often one is saved: not carried over


@dataclass(frozen=True, eq=False)
class Calibration:
    """Measured / predicted time of each part of a step on the hardware `cluster` names, from one `behemoth profile`."""

    cluster: str
    source: str
    compute: float = 1.0
    comm: float = 1.0
    bubble: float = 1.0
    offload: float = 1.0
    unmodelled: float = 0.0  # share of the measured step the planner does not model (data preparation, host work)
    rows: dict[str, tuple[float, float]] = field(default_factory=dict)  # part -> (measured, predicted) seconds

    def applies_to(self, inst: Instance) -> bool:
        return self.cluster in (inst.preset, inst.name)

    def step_seconds(self, plan: PlanCost) -> float:
        """`plan`'s predicted step with each part scaled by its factor, plus the unmodelled share."""
        share = plan.shares()
        scaled = (
            self.compute * (share["compute"] + share["recompute"] + share["optimizer"])
            + self.bubble * share["bubble"]
            + self.comm * (share["tp_comm"] + share["dp_comm"] + share["ep_comm"])
            + self.offload * share["offload"]
        )
        return plan.step_seconds * scaled / (1.0 - self.unmodelled)

    def describe(self) -> str:
        return (
            f"calibrated on {self.cluster} by {self.source}: compute x{self.compute:.2f}, comm x{self.comm:.2f}, "
            f"bubble x{self.bubble:.2f}, offload x{self.offload:.2f}, +{self.unmodelled:.0%} unmodelled"
        )


def _ratio(measured: float, predicted: float | None, default: float) -> float:
    return measured / predicted if predicted and measured > 0 else default


def load_calibration(path: str | Path) -> Calibration:
    """The factors of one `behemoth profile --json FILE` result (its `calibration` entry)."""
    file = Path(path).expanduser()
    try:
        entry = json.loads(file.read_text())["calibration"]
        got, pred, step = entry["measured"], entry["predicted"], float(entry["step"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BehemothError(
            f"--calibrate {file} is not a profile result ({type(err).__name__}: {err})", "write one with behemoth profile --json FILE"
        ) from None
    if entry.get("cluster") in (None, "local"):
        raise BehemothError(
            f"--calibrate {file} was predicted on this machine's own figures, not on an instance's preset",
            "profile on the instance type with --cluster PRESET (the catalog entry's preset), then pass that result",
        )

    def total(keys: tuple[str, ...], src: dict[str, float | None]) -> float:
        return sum(src[k] or 0.0 for k in keys)

    compute = _ratio(total(COMPUTE_ROWS, got), total(COMPUTE_ROWS, pred), 1.0)
    rows = {k: (float(got[k]), float(pred[k] or 0.0)) for k in (*COMPUTE_ROWS, *COMM_ROWS, "bubble", "offload")}
    return Calibration(
        cluster=entry["cluster"],
        source=file.name,
        compute=compute,
        comm=_ratio(total(COMM_ROWS, got), total(COMM_ROWS, pred), 1.0),
        bubble=_ratio(got["bubble"], pred["bubble"], compute),  # idle time is a share of compute where none was measured
        offload=_ratio(got["offload"], pred["offload"], 1.0),
        unmodelled=min(total(UNMODELLED_ROWS, got) / step, 0.9) if step > 0 else 0.0,
        rows=rows,
    )


@dataclass
class Option:
    """`nodes` instances of `instance` running `plan`: hours and dollars to train the tokens asked for (with the step
    rescaled by a profile's `calibration` when one applies to the instance type)."""

    instance: Instance
    nodes: int
    plan: PlanCost
    steps: int
    calibration: Calibration | None = None

    @property
    def step_seconds(self) -> float:
        return self.calibration.step_seconds(self.plan) if self.calibration else self.plan.step_seconds

    @property
    def hours(self) -> float:
        return self.steps * self.step_seconds / 3600

    @property
    def cost(self) -> float:
        return self.hours * self.nodes * self.instance.price_per_hour

    def describe(self) -> str:
        return f"{self.nodes} x {self.instance.name} ({self.nodes * self.instance.devices} devices)"


def best_plan(
    work: Workload, inst: Instance, nodes: int, space: Space = EVERY_LAYOUT, cfg: Any = None, calibration: Calibration | None = None
) -> PlanCost | None:
    """The planner's fastest plan within `space` that fits on `nodes` instances of `inst`, or None; with a calibration,
    the fastest of the planner's top plans once each is rescaled by it."""
    cluster = cluster_of(inst, nodes)
    ranked = search(work, cluster, cluster.world, space, cfg=cfg, top=4, exact=4).ranked
    if not ranked:
        return None
    return min(ranked, key=calibration.step_seconds) if calibration else ranked[0]


def options(
    work: Workload, catalog: Catalog, tokens: float, space: Space = EVERY_LAYOUT, cfg: Any = None, calibrations: tuple[Calibration, ...] = ()
) -> list[Option]:
    """Every (instance type, count) with a plan in `space` that fits, priced for `tokens` training tokens (the first
    calibration that applies to an instance type rescales its steps)."""
    steps = math.ceil(tokens / work.tokens_per_step)
    unused = [c for c in calibrations if not any(c.applies_to(i) for i in catalog.instances)]
    if unused:
        have = ", ".join(sorted({i.preset for i in catalog.instances} | {i.name for i in catalog.instances}))
        raise BehemothError(
            f"--calibrate {unused[0].source} was measured on {unused[0].cluster}, which no catalog instance has as its preset or name",
            f"profile with --cluster set to one of: {have}",
        )
    out = []
    for inst in catalog.instances:
        cal = next((c for c in calibrations if c.applies_to(inst)), None)
        for nodes in range(1, inst.max_nodes + 1):
            plan = best_plan(work, inst, nodes, space, cfg, cal)
            if plan is not None:
                out.append(Option(inst, nodes, plan, steps, cal))
    return out


def choose(found: list[Option], deadline_h: float | None, budget: float | None) -> tuple[Option | None, Option | None, list[Option]]:
    """(choice, runner-up, the options that qualify): the cheapest meeting the deadline and budget, or with a budget
    alone the fastest within it; the runner-up is the best qualifying option of another instance type (else the next)."""
    ok = [o for o in found if (deadline_h is None or o.hours <= deadline_h) and (budget is None or o.cost <= budget)]
    key = (lambda o: (o.hours, o.cost)) if budget is not None and deadline_h is None else (lambda o: (o.cost, o.hours))
    ok.sort(key=key)
    if not ok:
        return None, None, ok
    rest = [o for o in ok[1:] if o.instance.name != ok[0].instance.name] or ok[1:]
    return ok[0], (rest[0] if rest else None), ok


def why_not(choice: Option, other: Option) -> str:
    """Why `other` lost to `choice`, in numbers."""
    dc, dh = other.cost - choice.cost, other.hours - choice.hours
    money = f"${abs(dc):,.0f} ({abs(dc) / choice.cost:.0%}) {'more' if dc >= 0 else 'less'}"
    time = f"{abs(dh):,.1f} h {'longer' if dh >= 0 else 'shorter'}"
    return f"{money}, {time}; its plan is bound by {other.plan.binding(cluster_of(other.instance, other.nodes))}"
