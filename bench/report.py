"""What every `tokenfleet bench` command ends with: the table on stdout, the figures as JSON in
bench/results/<benchmark>-<host family>.json (the latest run of a benchmark on a kind of host: a run overwrites
the one before, and git keeps the history) or where `--json` says."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import NoReturn

RESULTS = Path(__file__).resolve().parent / "results"


def add_output_argument(p: argparse.ArgumentParser, benchmark: str) -> None:
    p.add_argument("--json", dest="json_path", type=Path, default=None, metavar="FILE",
                   help=f"write the figures here instead of bench/results/{benchmark}-<host family>.json")
    p.set_defaults(benchmark=benchmark)


def output_path(args: argparse.Namespace, variant: str | None = None) -> Path:
    """`--json`, else the benchmark's file for this host family (and `variant`, a run on another model). The family
    is looked up only when a run writes: it asks CUDA for the GPU's name, which building the command line (every
    `tokenfleet` command) must not do."""
    from .host import host_family

    name = args.benchmark if variant is None else f"{args.benchmark}-{variant}"
    return args.json_path or RESULTS / f"{name}-{host_family()}.json"


def publish(result: dict, table: str, path: Path | str, picture: bool = False) -> int:
    """Prints the table and writes the JSON; with `picture`, also its plot beside it (same name, .png)."""
    print(table)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(f"figures: {path}")
    if picture:
        try:
            from .plots import write_picture
        except ModuleNotFoundError as err:  # matplotlib comes with the dev extra only
            print(f"no picture ({err.name} is not installed: pip install -e '.[dev]')")
        else:
            print(f"picture: {write_picture(result, path.with_suffix('.png'))}")
    return 0


def script_main(doc: str, add_arguments, run_from_args) -> NoReturn:
    """A benchmark run as a script (`python -m bench.lab.NAME`, `python -m bench.gpu` where no console script is
    installed): the options of its command."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_arguments(p)
    sys.exit(run_from_args(p.parse_args()))


def in_turn(contestants: list, round_index: int) -> list:
    """The contestants' order in a round: each leads in turn, so that no one always runs first (or last) on a
    host whose speed drifts."""
    shift = round_index % len(contestants)
    return contestants[shift:] + contestants[:shift]


def spread(values: list[float]) -> str:
    """A ratio's rounds as the tables give them: median [min, max]."""
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"
