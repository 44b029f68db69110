"""What the `python3 -m ferry.bench_*` modules share: percentiles, running a `ferry bench`
subcommand beside them for its JSON report, and writing their own."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import tempfile
from typing import Callable, List, Optional


def percentile(v: List[float], p: float) -> float:
    """The p-quantile (0..1) of v, nearest rank; 0 when v is empty."""
    v = sorted(v)
    return v[min(len(v) - 1, int(p * (len(v) - 1) + 0.5))] if v else 0.0


def run_ferry_bench(ferry_bin: str, args: List[str]) -> dict:
    """`ferry bench <args> --json FILE`: its JSON report (its table goes nowhere)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "report.json")
        subprocess.run([ferry_bin, "bench", *args, "--json", out], check=True,
                       stdout=subprocess.DEVNULL, timeout=600)
        with open(out) as f:
            return json.load(f)


def write_json(path: Optional[str], result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def count(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi]. Out of range, a flag was a traceback out of a
    spawned rank (and a run that hung on the ranks still waiting for it) or a table of zeros."""
    def parse(text: str) -> int:
        try:
            v = int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"an integer, not {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {v}")
        return v
    return parse


def seconds(hi: float) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds in (0, hi] (nan ran forever)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a number of seconds, not {text!r}") from None
        if not (math.isfinite(v) and 0 < v <= hi):
            raise argparse.ArgumentTypeError(f"must be a number of seconds in (0, {hi:g}], "
                                             f"got {text}")
        return v
    return parse


def binary(text: str) -> str:
    """An argparse type: an executable file (the `ferry` binary to run beside)."""
    if not (os.path.isfile(text) and os.access(text, os.X_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} is not an executable file: pass the path of "
                                         "the ferry binary (build/ferry)")
    return text
