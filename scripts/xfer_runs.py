#!/usr/bin/env python3
"""Engine/raw ratios of `ferry bench xfer` pooled over several runs spread over time.

On a host where the bench's threads outnumber the cores (the 2-core dev machine: the engine's
submitter and worker, the target's poller, other processes), one run's pairs agree with each
other but runs minutes apart do not: the same point's median moved 0.66x-1.39x between runs
(docs/BENCHMARKS.md, 2026-12-03). So this runs the bench RUNS times with GAP seconds between,
each with many short alternating raw/engine pairs, and reports per point the median and
quartiles of all pairs together, beside each run's own median and the load average when it
started. With other binaries (--baseline B, repeatable), each round runs every binary, in an
order that is reversed every other round (A B B A ...), so all see the same spread of
moments, and each point gets a line per binary.

Usage: scripts/xfer_runs.py [--runs 6] [--gap 20] [--baseline OTHER_FERRY]... FERRY [flags]
  e.g. scripts/xfer_runs.py --runs 6 --gap 20 build/ferry --sizes 262144,1048576 \\
           --pages 4096 --latency-iters 0 --repeat 9 --seconds 0.1
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def quantile(xs, q):
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def run_once(binary, flags):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "xfer.json")
        cmd = [binary, "bench", "xfer", *flags, "--json", path]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if p.returncode != 0:
            sys.exit(f"xfer_runs: {' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-2000:]}")
        with open(path) as f:
            return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=6, help="runs per binary")
    ap.add_argument("--gap", type=float, default=20, help="seconds between runs")
    ap.add_argument("--baseline", action="append", default=[],
                    help="another ferry binary, run in every round (repeatable)")
    ap.add_argument("binary")
    args, flags = ap.parse_known_args()
    if args.runs < 1 or args.gap < 0:
        sys.exit("xfer_runs: --runs must be at least 1 and --gap at least 0")
    binaries = [args.binary] + args.baseline
    for b in binaries:
        if not os.access(b, os.X_OK):
            sys.exit(f"xfer_runs: {b} is not an executable")
    # A B B A A B ...: neither binary always runs first after a gap.
    order = []
    for i in range(args.runs):
        pair = binaries if i % 2 == 0 else binaries[::-1]
        order += pair
    pooled = {}  # (binary, point) -> all pairs' ratios
    per_run = {}  # (binary, point) -> [(median, load, clock)]
    for n, b in enumerate(order):
        if n and args.gap:
            time.sleep(args.gap)
        load = open("/proc/loadavg").read().split()[0]
        clock = time.strftime("%H:%M:%S", time.gmtime())
        rep = run_once(b, flags)
        for row in rep["rows"]:
            key = (b, (row["kind"], row["size_bytes"], row["peers"]))
            pooled.setdefault(key, []).extend(row["ratio_samples"])
            per_run.setdefault(key, []).append((row["median_ratio"], load, clock))
        print(f"run {n + 1}/{len(order)} {clock} UTC load {load}: {b}", file=sys.stderr)
    points = sorted({k[1] for k in pooled}, key=lambda p: (p[0], p[1], p[2]))
    print(f"{'point':<28} {'binary':<24} {'pairs':>5} {'median':>7} {'quartiles':>11}  "
          "runs' medians (load)")
    for p in points:
        for b in binaries:
            xs = pooled.get((b, p))
            if not xs:
                continue
            name = f"{p[0]} {p[1]} B" + (f" x{p[2]}" if p[2] > 1 else "")
            runs = " ".join(f"{m:.2f}({l})" for m, l, _ in per_run[(b, p)])
            print(f"{name:<28} {b[-24:]:<24} {len(xs):>5} {statistics.median(xs):>6.2f}x "
                  f"{quantile(xs, 0.25):>5.2f}-{quantile(xs, 0.75):.2f}x  {runs}")


if __name__ == "__main__":
    main()
