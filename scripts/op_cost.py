#!/usr/bin/env python3
"""Instructions per write of the engine and of the raw fi_write loop, from callgrind.

Runs `ferry bench xfer --rate-only` under `valgrind --tool=callgrind` (valgrind is not a
dependency of the project: install it to use this script), once for the submit_batch row and
once for the submit_all row, one profile file per thread, and divides:
  raw        the raw loop's instructions (RawEndpoint::rate_loop, inclusive) by its writes
  submitter  the engine loop's instructions on the calling thread (engine_rate_loop,
             inclusive: building, handing over, the bench's window) by the engine's writes
  worker     everything the rail's worker thread executed (Rail::run, inclusive: idle passes
             and the few set-up tasks included) by the engine's writes, with its largest parts
and splits raw and engine into the provider's part (calls into libfabric, inclusive) and the
rest. The provider's part includes spinning on shm's locks while the target (slowed down by
valgrind like everything else) holds them, so it moves from run to run; the rest does not
depend on the provider's speed: that is the figure to compare between builds.
Instruction counts do not depend on the load of the host, unlike the bench's timings; they
do include polling, whose amount depends on how valgrind schedules the threads (one at a
time), so compare runs of the same command.

Usage: scripts/op_cost.py FERRY_BINARY [extra bench flags...]
  e.g. scripts/op_cost.py build/ferry --rate-sizes 64 --rate-peers 1
"""
import glob
import os
import re
import subprocess
import sys
import tempfile

# Worker functions reported beside the worker's total (inclusive, per write).
WORKER_PARTS = [
    "ferry::detail::Rail::drain_submissions()",
    "ferry::detail::Rail::post_pending()",
    "ferry::detail::Rail::poll_cq()",
    "ferry::detail::OpState::finish(",
    "ferry::detail::Rail::retire_finished()",
    "ferry::detail::Rail::sweep_timeouts(",
]


# The worker's per-write path (inclusive): everything it does for a write but idle polling.
PATH_PARTS = [
    "ferry::detail::Rail::drain_submissions()",
    "ferry::detail::Rail::post_pending()",
    "ferry::detail::Rail::retire_finished()",
]


def inclusive_costs(path):
    """{function: inclusive Ir} of one callgrind output file."""
    out = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", path],
        check=True, capture_output=True, text=True).stdout
    costs = {}
    total = 0
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(?:[^:\s]+:)?(.*)$", line)
        if not m:
            continue
        n = int(m.group(1).replace(",", ""))
        name = m.group(2).strip()
        if "PROGRAM TOTALS" in line:
            total = n
            continue
        if name.startswith("file:function") or not name:
            continue
        # "file:function [object]": keep the function
        name = re.sub(r"\s*\[[^\]]*\]$", "", name)
        costs[name] = max(costs.get(name, 0), n)
    costs["<total>"] = total
    return costs


def provider_costs(path):
    """{caller function: inclusive Ir of its calls into libfabric} of one callgrind file: the
    provider's share (its spin on shm's locks included), apart from the engine's own work."""
    names = {"ob": {}, "fn": {}}
    ob = fn = None
    cob = cfn = None
    pending_call = False
    out = {}

    def name(kind, v):
        m = re.match(r"\((\d+)\)(?: (.*))?", v)
        if not m:
            return v
        if m.group(2) is not None:
            names[kind][m.group(1)] = m.group(2)
        return names[kind].get(m.group(1), v)

    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if pending_call:
                pending_call = False
                parts = line.split()
                if len(parts) >= 2 and "libfabric" in (cob or ob or "") and \
                        "libfabric" not in (ob or ""):
                    out[fn] = out.get(fn, 0) + int(parts[1])
                cob = None
                continue
            if line.startswith("ob="):
                ob = name("ob", line[3:])
            elif line.startswith("fn="):
                fn = name("fn", line[3:])
                cob = None
            elif line.startswith("cob="):
                cob = name("ob", line[4:])
            elif line.startswith("cfn="):
                cfn = name("fn", line[4:])
            elif line.startswith("calls="):
                pending_call = True
    return out


def find(costs, needle):
    return max((v for k, v in costs.items() if needle in k), default=0)


def measure(binary, row, extra):
    """Runs one rate row under callgrind; returns (kind, raw writes, engine writes, raw Ir,
    submitter Ir, worker costs) or None."""
    work = tempfile.mkdtemp(prefix="op_cost.")
    cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes",
           f"--callgrind-out-file={work}/cg.%p", binary, "bench", "xfer", "--provider", "shm",
           "--rate-only", "--rate-rows", row, "--repeat", "1", "--seconds", "0.3"] + extra
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stdout, run.stderr)
        return None
    m = re.search(r"^\s+(\S+)\s+(\d+) B(?: x(\d+) peers)?: .*?writes in all passes: "
                  r"raw (\d+), engine (\d+)", run.stderr, re.M)
    if not m:
        print(run.stderr)
        return None
    # The initiator is the process whose main thread ran the raw loop.
    for main_file in glob.glob(f"{work}/cg.*-01"):
        main_costs = inclusive_costs(main_file)
        raw = find(main_costs, "RawEndpoint::rate_loop")
        if not raw:
            continue
        sub = find(main_costs, "engine_rate_loop") or find(main_costs, "engine_scatter_loop")
        raw_prov = sum(v for k, v in provider_costs(main_file).items() if "rate_loop" in k)
        # The rail's worker: the thread that ran the most of Rail::run() (another thread's
        # file may name it too, with a few instructions, and glob's order varies).
        worker = worker_prov = None
        worker_post_prov = 0
        for f in glob.glob(main_file[:-3] + "-*"):
            c = inclusive_costs(f)
            if find(c, "Rail::run()") > (find(worker, "Rail::run()") if worker else 0):
                worker = c
                prov = provider_costs(f)
                worker_prov = sum(prov.values())
                worker_post_prov = sum(v for k, v in prov.items()
                                       if "Rail::post_one" in k or "Rail::drain_submissions" in k)
        kind = f"{m.group(1)} {m.group(2)} B x{m.group(3) or 1}"
        return (kind, int(m.group(4)), int(m.group(5)), raw, sub, worker, work, raw_prov,
                worker_prov, worker_post_prov)
    return None


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    binary, extra = sys.argv[1], sys.argv[2:]
    print("valgrind --tool=callgrind --separate-threads=yes " + binary +
          " bench xfer --provider shm --rate-only --rate-rows ROW --repeat 1 --seconds 0.3 " +
          " ".join(extra), flush=True)
    for row in ("batch", "all"):
        r = measure(binary, row, extra)
        if not r:
            return 1
        kind, raw_n, eng_n, raw, sub, worker, work, raw_prov, worker_prov, post_prov = r
        w = find(worker, "Rail::run()")
        print(f"\n{kind}: raw writes {raw_n}, engine writes {eng_n} ({work})")
        print(f"  raw loop        {raw / raw_n:8.0f} instructions per write: provider "
              f"{raw_prov / raw_n:.0f}, the loop's own {(raw - raw_prov) / raw_n:.0f}")
        print(f"  engine          {(sub + w) / eng_n:8.0f}  = submitter {sub / eng_n:.0f}"
              f" + worker {w / eng_n:.0f}; provider {worker_prov / eng_n:.0f}, the engine's own "
              f"{(sub + w - worker_prov) / eng_n:.0f} (worker {(w - worker_prov) / eng_n:.0f})")
        # The worker's work per write without its idle passes (CQ reads that found nothing,
        # naps, sweeps), which vary with how valgrind schedules the threads: popping,
        # posting (the provider's post excluded), finishing and retiring.
        path = sum(find(worker, f) for f in PATH_PARTS)
        print(f"  worker's path   {(path - post_prov) / eng_n:8.0f}  (own instructions per write "
              f"in {', '.join(f.split('::')[-1] for f in PATH_PARTS)}; provider's post "
              f"{post_prov / eng_n:.0f} apart)")
        for part in WORKER_PARTS:
            v = find(worker, part)
            if v:
                print(f"    worker {part.split('::')[-1]:<22} {v / eng_n:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
