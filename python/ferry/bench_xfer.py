"""Small writes timed from Python (ferry.TransferEngine), beside `ferry bench xfer`.

    python3 -m ferry.bench_xfer --provider tcp [--ferry PATH_TO_ferry] [--seconds 2]

Two spawned processes, one engine each (workers nap when idle, as `ferry bench xfer`'s engines
do between points). Every figure that is compared with C++ is a named yardstick, measured
the same way by `ferry bench xfer` (its "yardsticks" section; engine to engine, same size,
provider and window) and printed beside it with the ratio:

- latency_64B: a ping-pong of 64-byte writes with immediates, one-way (half the round trip),
  p50 and p99 over --iters, each side's thread writing and then waiting for the other's
  immediate in wait_imm (polling for wait_spin_us, then sleeping until the engine's worker
  wakes it), in C++ with the same spin. Compared as Python minus C++. (`ferry bench xfer`'s
  own latency line, a ping-pong in the workers' completion callbacks, is the engine's floor.)
- rate_4KiB_write: 4 KiB writes with immediates to the one peer, one write() call per write,
  --window in flight (the oldest waited for before the next is posted), for --seconds.
- rate_4KiB_runs32: the same writes --batch (32) at a time through write_runs (each run a write
  carrying the immediate), --window writes in flight. Rates compared as Python / C++.

Python alone: the write() call, and from its return to the peer's wait_imm return (delivery
and wake-up; both processes read one monotonic clock). The target counts every immediate
before a rate is kept. With --ferry, `ferry bench xfer --yardsticks-only` runs on the same
provider after each Python run (the two alternate --repeat times, the best of each kept).
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ._bench import binary, count, percentile, run_ferry_bench, write_json
from ._bench import seconds as seconds_flag

PING, PONG, RATE = 0x50490000, 0x504F0000, 0x52410000
LATENCY_BYTES, RATE_BYTES, SLOTS = 64, 4096, 256  # as `ferry bench xfer`'s yardsticks


def yardsticks(window: int, batch: int, spin: float) -> List[Tuple[str, str, str]]:
    """(name, operation, unit) of each yardstick, as `ferry bench xfer` names them."""
    return [(f"latency_{LATENCY_BYTES}B", f"write+imm {LATENCY_BYTES} B one way, each side in "
             f"wait_imm (spin {spin:g} us), p50", "us"),
            ("rate_4KiB_write", f"write+imm 4 KiB, one write() per write, {window} in flight",
             "op/s"),
            (f"rate_4KiB_runs{batch}", f"write+imm 4 KiB, write_runs of {batch}, "
             f"{max(window // batch, 1) * batch} writes in flight", "op/s")]


def _target(conn: Any, provider: str, busy_poll: bool, wait_spin_us: Optional[float]) -> None:
    import numpy as np

    import ferry

    with ferry.TransferEngine(provider, same_host=True, busy_poll=busy_poll,
                              wait_spin_us=wait_spin_us) as e:
        buf = np.zeros(1 << 20, dtype=np.uint8)
        region = e.register(buf)
        conn.send((e.address, region.descriptor))
        peer_addr, peer_desc, iters, rate_writes = conn.recv()
        peer = e.connect(peer_addr)
        woke = [0.0] * iters
        clock = time.perf_counter
        for i in range(iters):
            e.wait_imm(PING, 1, 10.0)
            woke[i] = clock()
            e.write(peer, region, 0, peer_desc, 0, LATENCY_BYTES, imm=PONG)
        conn.send(woke)
        while True:  # each rate loop's immediates, counted before it is kept
            n = conn.recv()
            if n is None:
                break
            e.wait_imm(RATE, n, 60.0)
            conn.send("rate done")


def _rate_loop(e: Any, seconds: float, window: int, post: Callable[[int], Any], per_op: int,
               conn: Any) -> float:
    """Writes per second of `post(offset)` calls (each `per_op` writes with the immediate RATE),
    `window` calls in flight, once the target counted them all."""
    ops: collections.deque = collections.deque()
    n, slots, imms = 0, SLOTS, 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while True:
        if len(ops) >= window:
            ops.popleft().wait(10.0)
            if time.perf_counter() >= end:
                break
        op = post((n % slots) * RATE_BYTES)
        imms += op.imm_writes  # write_runs joins up to rma_iovs runs per immediate
        ops.append(op)
        n += 1
    writes = n * per_op
    for op in ops:
        op.wait(10.0)
    elapsed = time.perf_counter() - t0
    conn.send(imms)
    if not conn.poll(60) or conn.recv() != "rate done":
        raise RuntimeError("the target did not count every write")
    return writes / elapsed


def run(provider: str, iters: int, seconds: float, window: int, busy_poll: bool,
        batch: int, wait_spin_us: Optional[float] = None) -> dict:
    import numpy as np

    import ferry

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, provider, busy_poll, wait_spin_us),
                       daemon=True)
    proc.start()
    try:
        with ferry.TransferEngine(provider, same_host=True, busy_poll=busy_poll,
                                  wait_spin_us=wait_spin_us) as e:
            buf = np.random.default_rng(1).integers(0, 255, 1 << 20, dtype=np.uint8)
            region = e.register(buf)
            if not conn.poll(60):
                raise RuntimeError("bench target did not start within 60 s")
            addr, desc = conn.recv()
            dst = ferry.RemoteRegion.from_bytes(desc)
            peer = e.connect(addr)
            conn.send((e.address, region.descriptor, iters, 0))
            us, submit_us, posted = [], [], [0.0] * iters
            clock = time.perf_counter
            for i in range(iters):
                t0 = clock()
                e.write(peer, region, 0, dst, 0, LATENCY_BYTES, imm=PING)
                t1 = posted[i] = clock()
                e.wait_imm(PONG, 1, 10.0)
                us.append((clock() - t0) * 1e6 / 2)
                submit_us.append((t1 - t0) * 1e6)
            woke = conn.recv()
            skip = min(len(us) // 10, 200)
            warm = us[skip:]
            to_wake = [(w - p) * 1e6 for p, w in zip(posted[skip:], woke[skip:])]
            single = _rate_loop(e, seconds, window, lambda off: e.write(
                peer, region, off, dst, off, RATE_BYTES, imm=RATE), 1, conn)
            # write_runs: `batch` writes of 4 KiB per call, each carrying the immediate, window
            # // batch calls in flight, as `ferry bench xfer`'s rate_4KiB_runs yardstick.
            runs = [np.array([[(i * RATE_BYTES + off) % (SLOTS * RATE_BYTES)] * 2 + [RATE_BYTES]
                              for i in range(batch)], dtype=np.uint64)
                    for off in range(0, SLOTS * RATE_BYTES, batch * RATE_BYTES)]
            batched = _rate_loop(e, seconds, max(1, window // batch), lambda off: e.write_runs(
                peer, region, dst, runs[(off // RATE_BYTES) % len(runs)], imm=RATE), batch, conn)
            conn.send(None)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    from . import _wait_spin_us

    lat, one, many = (n for n, _, _ in yardsticks(window, batch, _wait_spin_us(wait_spin_us)))
    return {lat: percentile(warm, 0.5), lat + "_p99": percentile(warm, 0.99),
            one: single, many: batched, "latency_iters": len(warm),
            "write_call_p50_us": percentile(submit_us, 0.5),
            "call_return_to_peer_wake_p50_us": percentile(to_wake, 0.5)}


def run_cpp(ferry_bin: str, provider: str, seconds: float, iters: int, window: int,
            batch: int, spin: float) -> Dict[str, dict]:
    """`ferry bench xfer --yardsticks-only`: its yardsticks by name (what, unit, value, p99,
    raw), measured with this run's latency size, window, batch and wait_imm spin."""
    j = run_ferry_bench(ferry_bin, ["xfer", "--provider", provider, "--yardsticks-only",
                                    "--latency-size", str(LATENCY_BYTES), "--latency-iters",
                                    str(iters), "--window", str(window), "--rate-batch",
                                    str(batch), "--wait-spin-us", repr(float(spin)),
                                    "--seconds", str(seconds)])
    return j["yardsticks"]


def _best(runs: List[dict]) -> dict:
    """Per figure, the best run: the highest rate, the lowest time."""
    return {k: (max if k.startswith("rate") else min)(r[k] for r in runs) for k in runs[0]}


def _best_cpp(runs: List[Dict[str, dict]]) -> Dict[str, dict]:
    """Per yardstick, the C++ run with the best value (lowest latency, highest rate)."""
    return {k: (max if v["unit"] == "op/s" else min)((r[k] for r in runs),
                                                     key=lambda y: y["value"])
            for k, v in runs[0].items()}


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m ferry.bench_xfer",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--provider", default="tcp")
    ap.add_argument("--iters", type=count(1, 1000000), default=2000, help="latency ping-pongs")
    ap.add_argument("--seconds", type=seconds_flag(3600), default=2.0, help="rate measurement")
    ap.add_argument("--window", type=count(1, 65536), default=64, help="rate: writes in flight")
    ap.add_argument("--batch", type=count(1, 65536), default=32,
                    help="rate: writes per write_runs call in the batched loop")
    ap.add_argument("--busy-poll", action="store_true",
                    help="engine workers never nap (default: they nap after idle_spin_us)")
    ap.add_argument("--wait-spin-us", type=float, default=None,
                    help="TransferEngine(wait_spin_us=...) on both sides (default: the engine's "
                         "own choice, which depends on the CPUs this process may use)")
    ap.add_argument("--ferry", type=binary, help="the ferry binary: run `ferry bench xfer` beside")
    ap.add_argument("--repeat", type=count(1, 1000), default=3,
                    help="Python and C++ runs alternate this many times and the best figure of "
                         "each is kept (on a shared host the load moves between runs)")
    ap.add_argument("--json", help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    from . import _usable_cpus, _wait_spin_us

    batch = min(args.batch, args.window)  # as `ferry bench xfer` takes --rate-batch
    v = args.wait_spin_us
    if v is not None and not 0 <= v <= 1e6:  # nan too; before any process starts
        ap.error(f"--wait-spin-us: must be in [0, 1000000] microseconds, got {v:g}")
    # resolved here: the C++ yardstick waits with the same spin
    spin, cpus = _wait_spin_us(v), _usable_cpus()
    pys, cpps = [], []
    for _ in range(max(1, args.repeat)):
        pys.append(run(args.provider, args.iters, args.seconds, args.window, args.busy_poll,
                       batch, args.wait_spin_us))
        if args.ferry:
            cpps.append(run_cpp(args.ferry, args.provider, args.seconds, args.iters,
                                args.window, batch, spin))
    py, cpp = _best(pys), _best_cpp(cpps) if cpps else None
    res = {"provider": args.provider, "python": py, "python_runs": pys}
    if cpp:
        res["cpp"], res["cpp_runs"] = cpp, cpps
    res["wait_spin_us"], res["usable_cpus"] = spin, cpus
    print(f"ferry.TransferEngine from Python{' beside `ferry bench xfer`' if cpp else ''}, "
          f"provider {args.provider}, best of {len(pys)}; wait_spin_us {spin:g} "
          f"({cpus} usable CPUs)")
    print(f"{'yardstick':<18} {'operation':<70} {'unit':>5} {'Python':>11} {'C++':>11} "
          f"{'Python vs C++':>14}")
    res["yardsticks"] = {}
    for name, what, unit in yardsticks(args.window, batch, spin):
        mine, theirs = py[name], cpp[name]["value"] if cpp else None
        if cpp and cpp[name]["what"] != what:  # one operation, or no ratio
            raise RuntimeError(f"yardstick {name}: C++ measured {cpp[name]['what']!r}, Python "
                               f"{what!r}")
        y = {"what": what, "unit": unit, "python": mine, "cpp": theirs}
        if theirs is None:
            vs = "-"
        elif unit == "us":
            y["python_minus_cpp_us"] = mine - theirs
            vs = f"{mine - theirs:+.1f} us"
        else:
            y["python_over_cpp"] = mine / theirs if theirs else 0.0
            vs = f"{y['python_over_cpp']:.2f}x"
        res["yardsticks"][name] = y
        cpp_text = f"{theirs:>11.1f}" if theirs is not None else f"{'-':>11}"
        print(f"{name:<18} {what:<70} {unit:>5} {mine:>11.1f} {cpp_text} {vs:>14}")
        if unit == "us":
            p99 = cpp[name]["p99"] if cpp else None
            print(f"{'':<18} {'  the same, p99':<70} {unit:>5} {py[name + '_p99']:>11.1f} "
                  + (f"{p99:>11.1f}" if p99 is not None else f"{'-':>11}"))
    print(f"Python alone: write() call p50 {py['write_call_p50_us']:.1f} us; from its return "
          f"to the peer's wait_imm return p50 {py['call_return_to_peer_wake_p50_us']:.1f} us")
    print("targets: latency added by Python <= 2 us; rates >= 0.8x of C++")
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
