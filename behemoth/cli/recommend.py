"""`behemoth recommend`: which instance type, and how many, to train a model on T tokens: the planner's best plan on
each, its predicted time and cost, the cheapest meeting a deadline (or the fastest within a budget), the runner-up and
why (behemoth/profiler/recommend.py, docs/profiling.md)."""

from __future__ import annotations

import argparse

from behemoth.errors import BehemothError, exit_code


def recommend_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="behemoth recommend",
        description="Price the planner's best plan for a model on every instance type and count of a catalog; recommend one.",
        epilog=(
            "examples:\n"
            "  behemoth recommend --model gpt2-1.5b --tokens 10e9 --deadline 24\n"
            "  behemoth recommend --tokens 1e12 --budget 50000 model.n_layer=32 model.d_model=4096 model.n_head=32 "
            "model.context=2048 model.vocab_size=32000 train.global_batch=512\n"
            "prices in the shipped catalog are illustrative: edit it or pass --catalog FILE"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", metavar="M", help="a model preset (as model=M) or hf:ARCH")
    p.add_argument("--tokens", type=float, required=True, metavar="T", help="training tokens")
    p.add_argument("--deadline", type=float, metavar="H", help="hours the training may take")
    p.add_argument("--budget", type=float, metavar="USD", help="dollars the training may cost")
    p.add_argument("--catalog", metavar="FILE", help="instance catalog YAML (default: behemoth/planner/catalogs/instances.yaml)")
    p.add_argument(
        "--calibrate",
        action="append",
        default=[],
        metavar="PROFILE.json",
        help="a `behemoth profile --cluster PRESET --json FILE` result: rescale the steps of the instance types on that preset (repeatable)",
    )
    p.add_argument("--config", metavar="FILE", help="YAML config; key=value options override it")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config options (model shape, train.global_batch, train.precision)")
    return p


def recommend_main(argv: list[str] | None = None) -> int:
    """Entry point of `behemoth recommend`; exit code 3 when no option meets the constraints."""
    return exit_code(run_recommend, recommend_parser().parse_args(argv))


def run_recommend(args: argparse.Namespace) -> int:
    from behemoth.cli.plan import space_of
    from behemoth.config import load_config
    from behemoth.planner.layout import Workload
    from behemoth.profiler.recommend import choose, load_calibration, load_catalog, options

    if args.tokens <= 0 or (args.deadline is not None and args.deadline <= 0) or (args.budget is not None and args.budget <= 0):
        raise BehemothError(f"--tokens {args.tokens} / --deadline {args.deadline} / --budget {args.budget} must be positive", "pass positive numbers")
    given = list(args.overrides)
    if args.model:
        given.insert(0, f"model={args.model}")
    if not any(o.startswith("train.precision=") for o in given):
        given.append("train.precision=bf16")  # what a rented accelerator trains in
    cfg = load_config(args.config, given)
    catalog = load_catalog(args.catalog)
    calibrations = tuple(load_calibration(f) for f in args.calibrate)
    work = Workload.of(cfg)
    found = options(work, catalog, args.tokens, space_of(cfg), calibrations=calibrations)  # the parallel options a user pins are not varied
    choice, runner_up, ok = choose(found, args.deadline, args.budget)
    print(report(work, args, found, choice, runner_up, ok, catalog))
    return 0 if choice is not None else 3


def report(work, args, found, choice, runner_up, ok, catalog) -> str:  # noqa: ANN001
    """Per instance type its best count under the constraints (or its fastest), then the choice and the runner-up."""
    from behemoth.profiler.recommend import why_not

    s = work.census.shape
    lines = [
        f"behemoth recommend: {s.n_layer} layers x d_model {s.d_model}, {work.census.psi / 1e9:.2f}B parameters, "
        f"{args.tokens:.3g} tokens in steps of {work.tokens_per_step:,} ({work.precision}); catalog of {catalog.date or 'no date'}",
        f"  {'instances':<46}{'plan':<44}{'step s':>9}{'hours':>10}{'cost $':>13}  ok",
    ]
    for name in dict.fromkeys(o.instance.name for o in found):
        mine = [o for o in ok if o.instance.name == name] or sorted((o for o in found if o.instance.name == name), key=lambda o: o.hours)
        o = mine[0]
        mark = ("yes" if o in ok else "no") + (" (calibrated)" if o.calibration else "")
        lines.append(f"  {o.describe():<46}{o.plan.layout.describe():<44}{o.step_seconds:>9.2f}{o.hours:>10.1f}{o.cost:>13,.0f}  {mark}")
    for cal in dict.fromkeys(o.calibration for o in found if o.calibration):
        lines.append(f"  {cal.describe()}")
    missing = [i.name for i in catalog.instances if i.name not in {o.instance.name for o in found}]
    if missing:
        lines.append(f"  no plan fits on {', '.join(missing)} (up to their max_nodes)")
    want = " and ".join(x for x in (args.deadline and f"{args.deadline:g} h", args.budget and f"${args.budget:,.0f}") if x) or "no limit"
    if choice is None:
        lines.append(f"nothing in the catalog meets {want}: raise the deadline or budget, or add instance types / max_nodes")
        return "\n".join(lines)
    inst = choice.instance
    price = "illustrative price" if inst.illustrative else f"{inst.provider} price of {inst.price_date}: its source is in the catalog's price_source"
    lines.append(
        f"recommended ({want}): {choice.describe()}, {choice.hours:,.1f} h, ${choice.cost:,.0f} ({price}); plan {choice.plan.layout.describe()}"
    )
    if runner_up is not None:
        lines.append(f"runner-up: {runner_up.describe()}, {runner_up.hours:,.1f} h, ${runner_up.cost:,.0f}: {why_not(choice, runner_up)}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(recommend_main())
