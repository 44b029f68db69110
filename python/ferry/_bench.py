"""What the `python3 -m ferry.bench_*` modules share: percentiles, running a `ferry bench`
subcommand beside them for its JSON report, and writing their own."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from typing import List, Optional


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
