"""Small writes timed from Python (ferry.TransferEngine), beside `ferry bench xfer`.

    python3 -m ferry.bench_xfer --provider tcp [--ferry PATH_TO_ferry] [--seconds 2]

Two spawned processes, one engine each (workers nap when idle, as `ferry bench xfer`'s engines
do between points). Latency: a ping-pong of 64-byte writes with immediates, each side waiting
for the other's immediate with wait_imm (polling for the engine's wait_spin_us, then sleeping
until the engine's worker wakes it); half the round trip, p50 and p99 over --iters, and where
it goes: the write() call alone, and from its return to the peer's wait_imm return (delivery
and wake-up; both processes read one monotonic clock). Rate:
4 KiB writes with immediates to the one peer, one TransferEngine.write call per write, --window
in flight (the oldest waited for before the next is posted), for --seconds; then the same
writes --batch at a time through write_runs (each run a write carrying the immediate). The
target counts every immediate before a figure is kept. With --ferry, `ferry bench xfer` runs on the same
provider right after and its latency and 4 KiB rate are printed beside (its rate posts
batches of 32 through submit_batch to raw endpoints, its latency pings 8 bytes).
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import sys
import time
from typing import Any, Callable, List, Optional

from ._bench import binary, count, percentile, run_ferry_bench, write_json
from ._bench import seconds as seconds_flag

PING, PONG, RATE = 0x50490000, 0x504F0000, 0x52410000


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
            e.write(peer, region, 0, peer_desc, 0, 64, imm=PONG)
        conn.send(woke)
        while True:  # each rate loop's writes, counted before it is kept
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
    n, slots = 0, (1 << 20) // 4096
    t0 = time.perf_counter()
    end = t0 + seconds
    while True:
        if len(ops) >= window:
            ops.popleft().wait(10.0)
            if time.perf_counter() >= end:
                break
        ops.append(post((n % slots) * 4096))
        n += 1
    writes = n * per_op
    for op in ops:
        op.wait(10.0)
    elapsed = time.perf_counter() - t0
    conn.send(writes)
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
                e.write(peer, region, 0, dst, 0, 64, imm=PING)
                t1 = posted[i] = clock()
                e.wait_imm(PONG, 1, 10.0)
                us.append((clock() - t0) * 1e6 / 2)
                submit_us.append((t1 - t0) * 1e6)
            woke = conn.recv()
            skip = min(len(us) // 10, 200)
            warm = us[skip:]
            to_wake = [(w - p) * 1e6 for p, w in zip(posted[skip:], woke[skip:])]
            single = _rate_loop(e, seconds, window, lambda off: e.write(
                peer, region, off, dst, off, 4096, imm=RATE), 1, conn)
            # write_runs: `batch` writes of 4 KiB per call, each carrying the immediate, as
            # `ferry bench xfer` hands its rate writes over through submit_batch.
            runs = [np.array([[(i * 4096 + off) % (1 << 20)] * 2 + [4096] for i in range(batch)],
                             dtype=np.uint64) for off in range(0, 1 << 20, batch * 4096)]
            batched = _rate_loop(e, seconds, max(2, window // batch), lambda off: e.write_runs(
                peer, region, dst, runs[(off // 4096) % len(runs)], imm=RATE), batch, conn)
            conn.send(None)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return {"latency_p50_us": percentile(warm, 0.5), "latency_p99_us": percentile(warm, 0.99),
            "write_call_p50_us": percentile(submit_us, 0.5), "latency_iters": len(warm),
            "call_return_to_peer_wake_p50_us": percentile(to_wake, 0.5),
            "rate_4k_ops_per_s": single, "rate_4k_runs_ops_per_s": batched}


def run_cpp(ferry_bin: str, provider: str, seconds: float) -> dict:
    j = run_ferry_bench(ferry_bin, ["xfer", "--provider", provider, "--sizes", "4096", "--pages",
                                    "4096", "--rate", "--rate-sizes", "4096", "--rate-peers", "1",
                                    "--scatter-peers", "1", "--seconds", str(seconds)])
    rate = next(r for r in j["rows"] if r["kind"] == "write+imm" and r["size_bytes"] == 4096)
    write = next(r for r in j["rows"] if r["kind"] == "write" and r["size_bytes"] == 4096)
    return {"latency_p50_us": j["latency_us"]["p50"], "latency_p99_us": j["latency_us"]["p99"],
            "rate_4k_ops_per_s": rate["engine_ops_per_s"],
            "write_4k_ops_per_s": write["engine_ops_per_s"]}


def _best(runs: List[dict]) -> dict:
    """Per figure, the best run: the highest rate, the lowest time."""
    return {k: (max if "per_s" in k else min)(r[k] for r in runs) for k in runs[0]}


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
    pys, cpps = [], []
    for _ in range(max(1, args.repeat)):
        pys.append(run(args.provider, args.iters, args.seconds, args.window, args.busy_poll,
                       args.batch, args.wait_spin_us))
        if args.ferry:
            cpps.append(run_cpp(args.ferry, args.provider, args.seconds / 4))
    py, cpp = _best(pys), _best(cpps) if cpps else None
    res = {"provider": args.provider, "python": py, "python_runs": pys}
    if cpp:
        res["cpp"], res["cpp_runs"] = cpp, cpps
    from . import _usable_cpus, _wait_spin_us

    spin, cpus = _wait_spin_us(args.wait_spin_us), _usable_cpus()
    res["wait_spin_us"], res["usable_cpus"] = spin, cpus
    print(f"ferry.TransferEngine from Python, provider {args.provider}, best of {len(pys)}; "
          f"wait_spin_us {spin:g} ({cpus} usable CPUs)")
    print(f"{'':<28} {'Python':>12} {'C++':>12}")
    print(f"{'write() call p50 us':<28} {py['write_call_p50_us']:>12.1f} {'-':>12}")
    print(f"{'  return to peer wake p50':<28} {py['call_return_to_peer_wake_p50_us']:>12.1f} "
          f"{'-':>12}")
    for key, label in [("latency_p50_us", "write+imm latency p50 us"),
                       ("latency_p99_us", "write+imm latency p99 us"),
                       ("rate_4k_ops_per_s", "4 KiB write+imm rate op/s"),
                       ("rate_4k_runs_ops_per_s", "  the same, write_runs op/s")]:
        other = f"{cpp[key]:>12.1f}" if cpp and key in cpp else f"{'-':>12}"
        print(f"{label:<28} {py[key]:>12.1f} {other}")
    if cpp:
        added = py["latency_p50_us"] - cpp["latency_p50_us"]
        ratio = py["rate_4k_ops_per_s"] / cpp["rate_4k_ops_per_s"]
        runs_ratio = py["rate_4k_runs_ops_per_s"] / cpp["rate_4k_ops_per_s"]
        res.update(added_latency_us=added, rate_ratio=ratio, runs_rate_ratio=runs_ratio)
        print(f"added by Python: {added:+.1f} us per one-way write (target <= 2 us); rate "
              f"{ratio:.2f}x of C++ one write per call, {runs_ratio:.2f}x with write_runs of "
              f"{args.batch} (target >= 0.8x); C++ 4 KiB plain write rate "
              f"{cpp['write_4k_ops_per_s']:.0f} op/s")
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
