"""Run the registered scenarios side by side and write the report (``python -m bench --help``)."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.budgets import render_budgets
from bench.core import ROOT, SCENARIOS, Context, Figure, Scenario
from bench.scenarios import load_all

DEFAULT_OUTPUT = ROOT / "docs" / "benchmarks.md"


#: Where the sections written by other scripts start in docs/benchmarks.md (``python -m bench.size``):
#: a run of the bench keeps them as they are.
KEPT_MARKER = "<!-- Written by other scripts (each says which); python -m bench keeps what follows. -->"


def kept_sections(path: Path) -> str:
    """What follows :data:`KEPT_MARKER` in the report at ``path`` (with it), or ``""``."""
    try:
        text = path.read_text()
    except OSError:
        return ""
    at = text.find(KEPT_MARKER)
    return "" if at < 0 else "\n" + text[at:]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (a smoke test)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these scenarios (and baseline)")
    parser.add_argument(
        "--output",
        metavar="PATH",
        help=f"where to write the report; '-' for stdout (default: {DEFAULT_OUTPUT.relative_to(ROOT)},"
        " or stdout with --quick)",
    )
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument(
        "--rest",
        type=float,
        metavar="LOAD",
        help="first wait (at most 15 minutes) until the 5-minute load average is below LOAD"
        f" (default: {REST_LOAD} for a full run, no wait with --quick or --only; 0: no wait)",
    )
    return parser.parse_args(argv)


#: The 5-minute load average a full run waits for: a machine that worked hard in the last minutes
#: (a test suite, another run) reads everything slower, though its 1-minute load is already low.
REST_LOAD = 0.5
#: The longest it waits, in seconds.
REST_WAIT_S = 900.0


def wait_for_rest(
    below: float,
    *,
    at_most_s: float = REST_WAIT_S,
    every_s: float = 10.0,
    load: Callable[[], float] = lambda: os.getloadavg()[1],
) -> float:
    """Wait until ``load()`` (the 5-minute load average) is below ``below``, looking every ``every_s``,
    at most ``at_most_s``; return the seconds waited (0 when ``below`` is 0 or the machine is rested)."""
    started = time.monotonic()
    waited = 0.0
    while below > 0 and waited < at_most_s and load() >= below:
        if waited == 0:
            print(f"bench: waiting for a 5-minute load below {below} ...", file=sys.stderr, flush=True)
        time.sleep(min(every_s, at_most_s - waited))
        waited = time.monotonic() - started
    return waited


def select(args: argparse.Namespace) -> list[Scenario]:
    chosen = sorted(SCENARIOS.values(), key=lambda s: (s.order, s.name))
    if args.only:
        unknown = set(args.only) - set(SCENARIOS)
        if unknown:
            raise SystemExit(
                f"unknown scenario(s): {', '.join(sorted(unknown))}; known: {', '.join(SCENARIOS)}"
            )
        chosen = [s for s in chosen if s.name in args.only or s.name == "baseline"]
    if args.quick:
        chosen = [s for s in chosen if s.quick]
    return chosen


def machine_facts(ctx: Context) -> list[tuple[str, str]]:
    import dramatiq
    import redis
    import sqlalchemy

    import dramatiq_guard

    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [
        ("CPUs", f"{os.cpu_count()} ({usable} usable){' ' + cpu_model if cpu_model else ''}"),
        ("OS", platform.platform()),
        ("Python", f"{platform.python_implementation()} {platform.python_version()}"),
        ("dramatiq", dramatiq.__version__),
        ("dramatiq-guard", dramatiq_guard.__version__),
        ("redis-py", redis.__version__),
        ("redis-server", ctx.server.version() + " (private, loopback, no persistence)"),
        ("SQLAlchemy", sqlalchemy.__version__),
        ("load average at start", " ".join(f"{x:.2f}" for x in os.getloadavg())),
    ]


def fmt(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def comparison(figure: Figure, figures: dict[str, Figure]) -> str:
    if figure.vs is None:
        return "-"
    other = figures.get(figure.vs)
    if other is None:
        return f"n/a ({figure.vs} not measured)"
    if figure.compare == "delta":
        return f"{figure.value - other.value:+.2f} vs {figure.vs}"
    if other.value == 0:
        return f"n/a ({figure.vs} is 0)"
    return f"{figure.value / other.value:.2f}x {figure.vs}"


def render(
    facts: list[tuple[str, str]],
    command: str,
    quick: bool,
    ran: list[tuple[Scenario, list[Figure], float, str | None]],
) -> str:
    figures = {f"{s.name}/{f.key}": f for s, fs, _, _ in ran for f in fs}
    out = [
        "# Benchmarks",
        "",
        "Generated by the bench harness (`bench/`); do not edit by hand, run it again.",
        "Every scenario runs in the same run, against the same private `redis-server`, so the",
        "figures compare as ratios; absolute numbers depend on the machine.",
        "",
        f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
        + (" — **quick mode: small sizes, not for comparison**" if quick else ""),
        "",
        "## Command",
        "",
        "```",
        f"{command}    # from the repository root",
        "```",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in facts],
        "",
        "## Results",
        "",
        "| scenario | figure | value | unit | compared | how |",
        "|---|---|---:|---|---|---|",
    ]
    for scen, figs, _, error in ran:
        if error is not None:
            out.append(f"| {scen.name} | **failed** | | | | {error.splitlines()[-1]} |")
        for f in figs:
            better = "higher" if f.better == "higher" else "lower"
            out.append(
                f"| {scen.name} | {f.label} | {fmt(f.value)} | {f.unit} "
                f"| {comparison(f, figures)} | {(f.detail + ' ') if f.detail else ''}({better} is better) |"
            )
    out += ["", *render_budgets(figures), "", "## Scenarios", ""]
    for scen, _, seconds, _ in ran:
        out += [f"### {scen.name}: {scen.title}", "", scen.description, "", f"_Took {seconds:.1f} s._", ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    load_all()
    scenarios = select(args)
    if args.list:
        for s in sorted(SCENARIOS.values(), key=lambda s: (s.order, s.name)):
            print(f"{s.name:20} {'quick' if s.quick else 'full only':9} {s.title}")
        return 0
    output = args.output or ("-" if args.quick else str(DEFAULT_OUTPUT))
    python = Path(sys.executable)
    python_cmd = str(python.relative_to(ROOT)) if python.is_relative_to(ROOT) else "python"
    command = f"{python_cmd} -m bench" + "".join(f" {shlex.quote(a)}" for a in (argv or sys.argv[1:]))

    from harness import RedisServer

    rest = args.rest if args.rest is not None else 0.0 if args.quick or args.only else REST_LOAD
    waited = wait_for_rest(rest)
    failed = False
    with RedisServer() as server:
        ctx = Context(server, quick=args.quick)
        try:
            facts = machine_facts(ctx)
            if rest > 0:
                facts.append(("waited for a rested machine", f"{waited:.0f} s (5-minute load below {rest})"))
            ran: list[tuple[Scenario, list[Figure], float, str | None]] = []
            for scen in scenarios:
                print(f"bench: {scen.name} ...", file=sys.stderr, flush=True)
                ctx.flush()
                start = time.monotonic()
                error = None
                figs: list[Figure] = []
                try:
                    figs = list(scen.fn(ctx))
                except Exception:
                    error = traceback.format_exc()
                    failed = True
                    print(error, file=sys.stderr)
                finally:
                    ctx.stop_workers()
                seconds = time.monotonic() - start
                for f in figs:
                    print(f"bench:   {f.label}: {fmt(f.value)} {f.unit}", file=sys.stderr)
                ran.append((scen, figs, seconds, error))
        finally:
            ctx.close()

    report = render(facts, command, args.quick, ran)
    if output == "-":
        sys.stdout.write(report)
    else:
        Path(output).write_text(report + kept_sections(Path(output)))
        print(f"bench: wrote {output}", file=sys.stderr)
    return 1 if failed else 0
