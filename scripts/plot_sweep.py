#!/usr/bin/python3
"""Draws TTFT and TPOT against QPS, one column per input length, push beside pull.

Reads the result files of `ferry bench serve` named <mode>_qps<q>_in<in>_out<out>_iter<i>.json
(mode: push, pull, pull-inline, ...), averages the iterations of each point, writes a PNG and
prints a markdown table of the same numbers, with the TTFT breakdown the push target is stated
in: median transfer wait, decode wait and (transfer wait + decode wait) / TTFT, where the
results have them (docs/SERVING.md). Compute in these runs is modelled; KV transfers are
real (every result file says so in its "note").

    scripts/plot_sweep.py RESULTS_DIR [--out sweep.png] [--stat median|mean|p99]
"""
import argparse
import collections
import json
import pathlib
import re
import statistics
import sys

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

NAME = re.compile(
    r"^(?P<mode>.+)_qps(?P<qps>[0-9]+(?:\.[0-9]+)?)_in(?P<inp>[0-9]+)_out(?P<out>[0-9]+)"
    r"_iter(?P<it>[0-9]+)\.json$")
# Fixed colours per mode so push and pull look the same in every plot.
COLOURS = {"push": "tab:blue", "pull": "tab:orange", "pull-inline": "tab:red"}


def load(results_dir, stat):
    """Returns {(mode, input_len, output_len): {qps: {"ttft": x, "tpot": y, "failed": n, ...}}}."""
    samples = collections.defaultdict(lambda: collections.defaultdict(list))
    skipped = []
    for path in sorted(pathlib.Path(results_dir).glob("*.json")):
        m = NAME.match(path.name)
        if not m:
            skipped.append(path.name)
            continue
        try:
            data = json.loads(path.read_text())
            ttft = float(data[f"{stat}_ttft_ms"])
            tpot = float(data[f"{stat}_tpot_ms"])
        except (ValueError, KeyError) as err:
            print(f"warning: {path.name}: unreadable result ({err}); skipped", file=sys.stderr)
            continue
        key = (m["mode"], int(m["inp"]), int(m["out"]))
        timing = data.get("server_timing_ms", {})
        waits = tuple(timing[k]["median"] if k in timing else None
                      for k in ("transfer_wait_ms", "decode_wait_ms"))
        samples[key][float(m["qps"])].append(
            (ttft, tpot, int(data.get("failed", 0))) + waits + (data.get("median_wait_share"),))
    if skipped:
        print(f"note: {len(skipped)} files do not follow the naming scheme and were ignored",
              file=sys.stderr)
    points = {}
    for key, by_qps in samples.items():
        points[key] = {
            qps: {
                "ttft": statistics.fmean(s[0] for s in runs),
                "tpot": statistics.fmean(s[1] for s in runs),
                "failed": sum(s[2] for s in runs),
                "iters": len(runs),
                "transfer_wait": mean_or_none(s[3] for s in runs),
                "decode_wait": mean_or_none(s[4] for s in runs),
                "wait_share": mean_or_none(s[5] for s in runs),
            }
            for qps, runs in sorted(by_qps.items())
        }
    return points


def mean_or_none(values):
    values = list(values)
    return None if any(v is None for v in values) else statistics.fmean(values)


def plot(points, stat, out):
    input_lens = sorted({k[1] for k in points})
    modes = sorted({k[0] for k in points}, key=lambda m: (m != "push", m))
    fig, axes = plt.subplots(2, len(input_lens), figsize=(4.5 * len(input_lens), 7),
                             squeeze=False)
    for col, inp in enumerate(input_lens):
        for row, metric in enumerate(("ttft", "tpot")):
            ax = axes[row][col]
            for mode in modes:
                for (m, i, o), by_qps in sorted(points.items()):
                    if m != mode or i != inp:
                        continue
                    qps = list(by_qps)
                    ax.plot(qps, [by_qps[q][metric] for q in qps], marker="o",
                            color=COLOURS.get(mode), label=f"{mode} (out {o})")
            ax.set_xlabel("QPS")
            ax.set_ylabel(f"{stat} {metric.upper()} (ms)")
            ax.set_title(f"input {inp} tokens: {metric.upper()}")
            ax.grid(True, alpha=0.3)
            if metric == "ttft":
                ax.set_yscale("log")
            ax.legend(fontsize=8)
    fig.suptitle("ferry push vs pull (compute modelled, KV transfers real)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def table(points, stat):
    lines = [f"| mode | input | output | QPS | {stat} TTFT ms | {stat} TPOT ms | failed | "
             "transfer wait ms | decode wait ms | wait share |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    for (mode, inp, outl), by_qps in sorted(points.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for qps, p in by_qps.items():
            lines.append(f"| {mode} | {inp} | {outl} | {qps:g} | {p['ttft']:.1f} | "
                         f"{p['tpot']:.2f} | {p['failed']} | {fmt(p['transfer_wait'], '.1f')} | "
                         f"{fmt(p['decode_wait'], '.1f')} | {fmt(p['wait_share'], '.1%')} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results_dir")
    ap.add_argument("--out", default=None, help="PNG path (default: RESULTS_DIR/sweep.png)")
    ap.add_argument("--stat", default="median", choices=["mean", "median", "p99"])
    args = ap.parse_args()
    points = load(args.results_dir, args.stat)
    if not points:
        print(f"error: no <mode>_qps<q>_in<in>_out<out>_iter<i>.json files in {args.results_dir}",
              file=sys.stderr)
        return 1
    out = args.out or str(pathlib.Path(args.results_dir) / "sweep.png")
    plot(points, args.stat, out)
    print(table(points, args.stat))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
