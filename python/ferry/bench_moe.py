"""Dispatch and combine timed from Python (ferry.moe.AllToAll), beside `ferry bench moe`.

    python3 -m ferry.bench_moe --ranks 2 --tokens 128 --hidden 7168 --topk 8 --experts 256 \\
        --dtype fp8 [--backend cpu|cuda] [--ranks-per-node N] [--provider tcp]

Ranks are spawned processes (one per rank, as serving engines run them; `ferry bench moe` runs
threads of one process) meeting through torch.distributed (gloo). Each iteration starts with a
barrier; `dispatch` is one AllToAll.dispatch call (send and receive halves, the copy into the
padded [local experts, ranks * tokens, hidden] output included), `combine` one
AllToAll.combine (the copy out of expert_y included); the identity "experts" between them are
not timed. Samples of all ranks are pooled; p50 and p99 in microseconds. CUDA: both ranks on
GPU r % count, timed with CUDA events on the current stream.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
from typing import List


def _percentile(v: List[float], p: float) -> float:
    v = sorted(v)
    if not v:
        return 0.0
    i = max(0, min(len(v) - 1, int(-(-p * len(v) // 1)) - 1))
    return v[i]


def _rank(rank: int, args: argparse.Namespace, port: int, q) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import time

    import torch
    import torch.distributed as dist

    import ferry.moe as moe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ranks, timeout=datetime.timedelta(seconds=120))
    cuda = args.backend == "cuda"
    dev = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    fp8 = args.dtype == "fp8"
    dt = moe.fp8_dtype() if fp8 else torch.bfloat16
    rpn = args.ranks_per_node or args.ranks
    a = moe.AllToAll(args.tokens, args.experts, 1, args.hidden, args.hidden // 128, dt, dt,
                     torch.float32, args.topk, min(args.private_slots, args.tokens), dev,
                     ranks_per_node=rpn, provider=args.provider, timeout=60.0)
    nl, cap, h, t = a.num_local_experts, a.max_recv_tokens, args.hidden, args.tokens
    g = torch.Generator().manual_seed(args.seed * 1009 + rank)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(args.experts, generator=g)[:args.topk] for _ in range(t)])
    w = torch.rand(t, args.topk, generator=g)
    w = (w / w.sum(dim=1, keepdim=True)).float()
    xs = None
    if fp8:
        x, xs = moe.quantize_fp8(x)
        xs = xs.to(dev)
    x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
    cnt = torch.zeros(nl, dtype=torch.int32, device=dev)
    ox = torch.zeros(nl, cap, h, dtype=torch.uint8 if fp8 else torch.bfloat16, device=dev)
    ox = ox.view(dt) if fp8 else ox
    osc = torch.zeros(nl, cap, h // 128, dtype=torch.float32, device=dev) if fp8 else None
    y = torch.zeros(nl, cap, h, dtype=torch.bfloat16, device=dev)
    out = torch.zeros(t, h, dtype=torch.float32 if args.out_dtype == "fp32" else torch.bfloat16,
                      device=dev)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()

    disp: List[float] = []
    comb: List[float] = []
    for it in range(args.warmup + args.iters):
        dist.barrier()
        if cuda:
            e0, e1, e2, e3 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
            e0.record()
            a.dispatch(cnt, ox, osc, x, xs, idx, w)
            e1.record()
            if not fp8:  # identity experts, as on CPU below
                y.copy_(ox)
            e2.record()
            a.combine(out, idx, w, y)
            e3.record()
            torch.cuda.synchronize()
            a.synchronize()
            d_us, c_us = e0.elapsed_time(e1) * 1e3, e2.elapsed_time(e3) * 1e3
        else:
            t0 = time.perf_counter()
            a.dispatch(cnt, ox, osc, x, xs, idx, w)
            t1 = time.perf_counter()
            # Identity experts (untimed): the rows as bf16 (fp8: their bytes, values unused).
            if not fp8:
                y.copy_(ox)
            t2 = time.perf_counter()
            a.combine(out, idx, w, y)
            t3 = time.perf_counter()
            d_us, c_us = (t1 - t0) * 1e6, (t3 - t2) * 1e6
        if it >= args.warmup:
            disp.append(d_us)
            comb.append(c_us)
    dist.barrier()
    a.close()
    q.put((rank, disp, comb))
    dist.destroy_process_group()


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m ferry.bench_moe",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=0, help="default: all ranks")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--out-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="combine output (ferry bench moe --backend cpu sums into fp32)")
    ap.add_argument("--private-slots", type=int, default=32)
    ap.add_argument("--provider", default="tcp", help="engine provider between nodes")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    import torch.multiprocessing as tmp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, port, q)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    got = []
    try:
        for _ in procs:
            got.append(q.get(timeout=600))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    disp = [v for _, d, _ in got for v in d]
    comb = [v for _, _, c in got for v in c]
    rows = {"dispatch": disp, "combine": comb}
    print(f"ferry.moe from Python, {args.backend}: {args.ranks} ranks "
          f"({args.ranks_per_node or args.ranks} per node), {args.tokens} tokens x {args.hidden}, "
          f"top-{args.topk} of {args.experts} experts, {args.dtype} dispatch, bf16 combine "
          f"into {args.out_dtype}, "
          f"{args.iters} iterations after {args.warmup} warm-up")
    print(f"{'phase':<10} {'p50 us':>10} {'p99 us':>10}")
    res = {}
    for name, v in rows.items():
        res[name] = {"p50_us": _percentile(v, 0.5), "p99_us": _percentile(v, 0.99)}
        print(f"{name:<10} {res[name]['p50_us']:>10.1f} {res[name]['p99_us']:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "phases": res}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
