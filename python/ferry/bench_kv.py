"""A KV push timed from Python (ferry.kv.KvConnector), beside `ferry bench kv`.

    python3 -m ferry.bench_kv --provider shm --tokens 16384 --layers 16 [--ferry PATH_TO_ferry]

As `ferry bench kv --mode push` does it: one process, a prefill and a decode engine (workers
polling without napping), each with a connector over a pool of one torch tensor per layer
(vLLM's [2, num_blocks, block_size, heads, head_dim], regions "per-layer"); decode registers
its blocks, and once the REGISTER reached prefill the clock starts, prefill_done is called, and
the clock stops when decode's poll() returns the receive. One untimed warm-up request, whose
every KV byte is checked; p50 and p99 over --iters. With --ferry, `ferry bench kv` runs the
same shape and split after each Python run (--repeat times, the best p50 of each kept), and
both are printed side by side (target: within 5%).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, List

from ._bench import binary, count, percentile, run_ferry_bench, write_json


def _wait_event(conn: Any, kind: str, tid: int, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        for e in conn.poll():
            if e.kind == kind and e.transfer_id == tid:
                e.raise_if_error()
                return e
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"bench: no {kind} event for transfer {tid} in {timeout} s")
        conn.wait(left)


def run(args: argparse.Namespace) -> dict:
    import torch

    import ferry
    import ferry.kv as fkv

    torch.set_num_threads(1)
    nblocks = -(-args.tokens // args.block_size)
    layout = fkv.KvLayout(args.layers, args.kv_heads, args.head_dim, 2, args.block_size,
                          nblocks * 5 // 4 + 4, regions="per-layer")
    shape = (2, layout.num_blocks, args.block_size, args.kv_heads, args.head_dim)
    g = torch.Generator().manual_seed(args.seed)
    sides = {}
    for name in ("prefill", "decode"):
        engine = ferry.TransferEngine(args.provider, same_host=True, op_timeout=60.0,
                                      busy_poll=True)
        if name == "prefill":
            pool = [torch.randint(-(1 << 15), 1 << 15, shape, generator=g, dtype=torch.int16)
                    for _ in range(args.layers)]
        else:
            pool = [torch.full(shape, -0x5455, dtype=torch.int16) for _ in range(args.layers)]
        conn = fkv.KvConnector(engine, layout, pool, fkv.KvConfig(lease=120.0))
        sides[name] = (engine, pool, conn)
    (pe, ppool, pconn), (de, dpool, dconn) = sides["prefill"], sides["decode"]
    blocks = list(range(nblocks))
    lat_ms = []
    nbytes = 0
    try:
        for it in range(-1, args.iters):
            tid = it + 2
            before = pconn.stats()["messages_received"]
            dconn.register_push(tid, 1, [pe.address], blocks, args.tokens)
            deadline = time.monotonic() + 60
            while pconn.stats()["messages_received"] == before:
                if time.monotonic() > deadline:
                    raise TimeoutError("bench: REGISTER never arrived")
                time.sleep(50e-6)
            t0 = time.perf_counter()
            pconn.prefill_done(tid, blocks, args.tokens)
            recv = _wait_event(dconn, "recv", tid, 120)
            t1 = time.perf_counter()
            _wait_event(pconn, "send", tid, 120)
            nbytes = recv.bytes
            if it < 0:
                t = args.tokens
                for layer in range(args.layers):
                    got = dpool[layer][:, :nblocks].reshape(2, -1, args.kv_heads, args.head_dim)
                    want = ppool[layer][:, :nblocks].reshape(2, -1, args.kv_heads, args.head_dim)
                    if not torch.equal(got[:, :t], want[:, :t]):
                        raise RuntimeError(f"bench: layer {layer} holds wrong KV bytes")
                print(f"  verified every KV byte of a {t}-token request", file=sys.stderr)
                continue
            lat_ms.append((t1 - t0) * 1e3)
    finally:
        dconn.close()
        pconn.close()
        de.close()
        pe.close()
    p50 = percentile(lat_ms, 0.5)
    return {"p50_ms": p50, "p99_ms": percentile(lat_ms, 0.99), "bytes": nbytes,
            "gbps": nbytes / (p50 * 1e6) if p50 else 0.0}


def run_cpp(args: argparse.Namespace) -> dict:
    row = run_ferry_bench(args.ferry, [
        "kv", "--mode", "push", "--tokens", str(args.tokens), "--layers", str(args.layers),
        "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim), "--elem-size", "2",
        "--block-size", str(args.block_size), "--regions", "per-layer", "--provider",
        args.provider, "--iters", str(args.iters), "--no-ceiling"])["rows"][0]
    return {"p50_ms": row["p50_ms"], "p99_ms": row["p99_ms"], "bytes": row["bytes"],
            "gbps": row["gbps"]}


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m ferry.bench_kv",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--tokens", type=count(1, 1 << 20), default=16384)
    ap.add_argument("--layers", type=count(1, 1024), default=16)
    ap.add_argument("--kv-heads", type=count(1, 1024), default=8)
    ap.add_argument("--head-dim", type=count(1, 1 << 16), default=128)
    ap.add_argument("--block-size", type=count(1, 1 << 16), default=16)
    ap.add_argument("--iters", type=count(1, 1000000), default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ferry", type=binary, help="the ferry binary: run `ferry bench kv` beside")
    ap.add_argument("--repeat", type=count(1, 1000), default=3,
                    help="Python and C++ runs alternate this many times and the run with the "
                         "best p50 of each is kept (on a shared host the load moves between runs)")
    ap.add_argument("--json", help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    # Two pools (prefill, decode) of about the request's size, int16 K and V: checked before
    # torch fills them (past the host's memory that was minutes of filling, then the OOM killer).
    blocks = -(-args.tokens // args.block_size) * 5 // 4 + 4  # as run() sizes them
    need = 2 * blocks * args.block_size * args.layers * 2 * args.kv_heads * args.head_dim * 2
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > host // 2:
        ap.error(f"--tokens {args.tokens} x --layers {args.layers} x --kv-heads {args.kv_heads} "
                 f"x --head-dim {args.head_dim} need {need / 2**30:.1f} GiB of KV pools, more "
                 f"than half of this host's {host / 2**30:.1f} GiB; use smaller values")
    pys, cpps = [], []
    for _ in range(max(1, args.repeat)):
        pys.append(run(args))
        if args.ferry:
            cpps.append(run_cpp(args))
    py = min(pys, key=lambda r: r["p50_ms"])
    cpp = min(cpps, key=lambda r: r["p50_ms"]) if cpps else None
    res = {"config": vars(args), "python": py, "python_runs": pys, "cpp_runs": cpps}
    print(f"best of {len(pys)} runs: KV push of {args.tokens} tokens ({py['bytes'] / 2**20:.0f} MiB: {args.layers} layers, "
          f"{args.kv_heads} KV heads x {args.head_dim}, 2-byte elements, {args.block_size}-token "
          f"blocks, per-layer tensors), provider {args.provider}, {args.iters} iterations")
    print(f"{'':<10} {'p50 ms':>10} {'p99 ms':>10} {'GB/s':>8}")
    for name, r in [("Python", py)] + ([("C++", cpp)] if cpp else []):
        print(f"{name:<10} {r['p50_ms']:>10.2f} {r['p99_ms']:>10.2f} {r['gbps']:>8.2f}")
    if cpp:
        res["cpp"] = cpp
        res["ratio"] = py["p50_ms"] / cpp["p50_ms"]
        print(f"Python p50 / C++ p50: {res['ratio']:.3f} (target <= 1.05)")
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
