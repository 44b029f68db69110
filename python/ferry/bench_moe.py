"""Dispatch and combine timed from Python (ferry.moe.AllToAll), beside `ferry bench moe`.

    python3 -m ferry.bench_moe --ranks 2 --tokens 128 --hidden 7168 --topk 8 --experts 256 \\
        --dtype fp8 [--backend cpu|cuda] [--ranks-per-node N] [--provider tcp]

Ranks are spawned processes (one per rank, as serving engines run them) meeting through
torch.distributed (gloo), or threads of this process (`--launch threads`, the default where
CUDA ranks outnumber the GPUs: processes sharing a GPU take turns on it in time slices, so a
kernel waiting for a peer's waits out a slice; `ferry bench moe` runs threads too). `dispatch`
is one AllToAll.dispatch call (send and receive halves, straight into the padded [local
experts, ranks * tokens, hidden] output), `combine` one AllToAll.combine (reading expert_y in
that layout); the identity "experts" between them are not timed. Samples of all ranks are
pooled; p50 and p99 in microseconds. CPU: host clock around each call, after a barrier. CUDA:
rank r on GPU r % count with a stream of its own; every rank enqueues its layer behind a start
gate, which one store opens for all after a barrier, and CUDA events time the phases, as
`ferry bench moe --backend cuda` does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import threading
from typing import List, Optional, Tuple

from ._bench import count


def _percentile(v: List[float], p: float) -> float:
    v = sorted(v)
    if not v:
        return 0.0
    i = max(0, min(len(v) - 1, int(-(-p * len(v) // 1)) - 1))
    return v[i]


class _Threads:
    """The meeting point of ranks that are threads of this process: an all-gather of bytes
    (the all-to-all's setup) and a barrier."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=120)
        self.slots: List[bytes] = [b""] * n

    def allgather(self, rank: int, blob: bytes) -> List[bytes]:
        self.slots[rank] = bytes(blob)
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read them all
        return out


def _register_gate(gate) -> None:
    """Pins the shared gate word for this process's CUDA context (mapped, portable), so the
    gate kernel reads the host store that opens it."""
    import torch

    rc = torch.cuda.cudart().cudaHostRegister(gate.data_ptr(), gate.element_size(), 3)
    code = int(getattr(rc, "value", rc))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of the start gate failed (CUDA error {code})")


def _rank(rank: int, args: argparse.Namespace, port: int, gate, threads: Optional[_Threads]
          ) -> Tuple[List[float], List[float]]:
    import time

    import torch

    import ferry.moe as moe
    from ferry import _ferry

    cuda = args.backend == "cuda"
    if threads is None:
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=args.ranks, timeout=datetime.timedelta(seconds=120))
        barrier = dist.barrier
        meet = dict()
        if cuda:
            _register_gate(gate)
    else:
        barrier = threads.barrier.wait
        meet = dict(rank=rank, world_size=args.ranks,
                    allgather=lambda b: threads.allgather(rank, b))
    dev = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    stream = None
    if cuda:
        torch.cuda.set_device(dev)
        stream = torch.cuda.Stream(dev)  # one per rank, as each rank's own process would have
    fp8 = args.dtype == "fp8"
    dt = moe.fp8_dtype() if fp8 else torch.bfloat16
    rpn = args.ranks_per_node or args.ranks
    with (torch.cuda.stream(stream) if cuda else _nullcontext()):
        a = moe.AllToAll(args.tokens, args.experts, 1, args.hidden,
                         args.hidden // 128 if fp8 else None, dt, torch.bfloat16,
                         torch.float32 if fp8 else None, args.topk, min(args.private_slots, args.tokens), dev,
                         ranks_per_node=rpn, provider=args.provider, timeout=60.0, **meet)
        nl, cap, h, t = a.num_local_experts, a.max_recv_tokens, args.hidden, args.tokens
        g = torch.Generator().manual_seed(args.seed * 1009 + rank)
        x = torch.randn(t, h, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(args.experts, generator=g)[:args.topk]
                           for _ in range(t)])
        w = torch.rand(t, args.topk, generator=g)
        w = (w / w.sum(dim=1, keepdim=True)).float()
        xs = None
        if fp8:
            x, xs = moe.quantize_fp8(x)
            xs = xs.to(dev)
        # idx stays int64 (torch's index dtype, as serving engines pass it).
        x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
        cnt = torch.zeros(nl, dtype=torch.int32, device=dev)
        ox = torch.zeros(nl, cap, h, dtype=torch.uint8 if fp8 else torch.bfloat16, device=dev)
        ox = ox.view(dt) if fp8 else ox
        osc = torch.zeros(nl, cap, h // 128, dtype=torch.float32, device=dev) if fp8 else None
        y = torch.zeros(nl, cap, h, dtype=torch.bfloat16, device=dev)
        out = torch.zeros(t, h, dtype=torch.float32 if args.out_dtype == "fp32"
                          else torch.bfloat16, device=dev)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if cuda else []
        if cuda:
            torch.cuda.synchronize(dev)
        # Ranks sharing a GPU: every allocation is done before any rank's kernels wait for a
        # peer (cuda_all_to_all.h).
        barrier()
        if cuda:
            # Identity experts on the GPU write the rows received, as `ferry bench moe`'s do
            # (dequantized fp8, or the bf16 rows): the combine then reads expert outputs just
            # written, as after a real expert GEMM, not a buffer gone cold. The routing is the
            # same every call, so one untimed layer tells which slab rows are real.
            a.dispatch(cnt, ox, osc, x, xs, idx, w)
            a.combine(out, idx, w, y)
            a.synchronize()
            counts = cnt.cpu().tolist()
            real = torch.tensor([e * cap + r for e in range(nl) for r in range(counts[e])],
                                dtype=torch.int64, device=dev)
            yv, oxv = y.view(nl * cap, h), ox.view(torch.uint8 if fp8 else torch.bfloat16)
            oxv = oxv.view(nl * cap, -1)

            def experts() -> None:
                rows = oxv.index_select(0, real)
                if fp8:
                    sc = osc.view(nl * cap, h // 128).index_select(0, real)
                    rows = moe.dequantize_fp8(rows.view(dt), sc)
                yv.index_copy_(0, real, rows)

            # Once now, so that the allocator holds its temporaries before any rank's layer
            # waits behind a gate (an allocation may wait for the whole device).
            experts()
            torch.cuda.synchronize(dev)
            barrier()

        disp: List[float] = []
        comb: List[float] = []
        for it in range(args.warmup + args.iters):
            if cuda:
                # The layer is enqueued behind the gate on every rank, then one store opens
                # them all (as `ferry bench moe` does): the events time the GPU's work, not
                # Python's launch gaps or the ranks' skew.
                want = it + 1
                _ferry.cuda_host_gate(gate.data_ptr(), want, 60.0, stream.cuda_stream)
                ev[0].record()
                a.dispatch(cnt, ox, osc, x, xs, idx, w)
                ev[1].record()
                experts()
                ev[2].record()
                a.combine(out, idx, w, y)
                ev[3].record()
                barrier()
                if rank == 0:
                    gate[0] = want
                a.synchronize()
                d_us, c_us = ev[0].elapsed_time(ev[1]) * 1e3, ev[2].elapsed_time(ev[3]) * 1e3
            else:
                barrier()
                t0 = time.perf_counter()
                a.dispatch(cnt, ox, osc, x, xs, idx, w)
                t1 = time.perf_counter()
                # Identity experts (untimed): the rows as bf16 (fp8: their bytes, values
                # unused).
                if not fp8:
                    y.copy_(ox)
                t2 = time.perf_counter()
                a.combine(out, idx, w, y)
                t3 = time.perf_counter()
                d_us, c_us = (t1 - t0) * 1e6, (t3 - t2) * 1e6
            if it >= args.warmup:
                disp.append(d_us)
                comb.append(c_us)
        barrier()
        a.close()
    if threads is None:
        import torch.distributed as dist

        dist.destroy_process_group()
    return disp, comb


def _process_rank(rank: int, args: argparse.Namespace, port: int, gate, q) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        disp, comb = _rank(rank, args, port, gate, None)
    except BaseException as e:  # the parent reports it and stops the other ranks
        q.put((rank, None, f"{type(e).__name__}: {e}"))
        sys.exit(1)
    q.put((rank, disp, comb))


def _collect(procs: list, q, timeout: float) -> Tuple[list, List[str]]:
    """Every rank's (rank, dispatch, combine), or why not: a rank's error, a rank that died
    without a word, or the timeout. Waited for in slices, so that one failed rank ends the run
    at once instead of after `timeout` (the parent used to wait the full 600 s for results that
    would never come, while the other ranks waited for the failed one)."""
    import queue
    import time

    got: list = []
    errors: List[str] = []
    deadline = time.monotonic() + timeout
    while len(got) < len(procs) and not errors:
        try:
            rank, disp, comb = q.get(timeout=0.5)
        except queue.Empty:
            reported = {r for r, _, _ in got}
            # A rank that exited with an error status put its error first, unless it was
            # killed or crashed: then nothing will come.
            for r, p in enumerate(procs):
                if r not in reported and p.exitcode not in (None, 0) and q.empty():
                    errors.append(f"rank {r}: exited with status {p.exitcode} without a result")
            if not errors and time.monotonic() > deadline:
                errors.append(f"no result from every rank within {timeout:.0f} s")
            continue
        if disp is None:
            errors.append(f"rank {rank}: {comb}")
        else:
            got.append((rank, disp, comb))
    return got, errors


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m ferry.bench_moe",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--ranks", type=count(1, 64), default=2)
    ap.add_argument("--ranks-per-node", type=count(0, 64), default=0, help="default: all ranks")
    ap.add_argument("--tokens", type=count(1, 65536), default=128)
    ap.add_argument("--hidden", type=count(128, 1 << 16), default=7168)
    ap.add_argument("--topk", type=count(1, 64), default=8)
    ap.add_argument("--experts", type=count(1, 1 << 16), default=256)
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--out-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="combine output (ferry bench moe --backend cpu sums into fp32)")
    ap.add_argument("--private-slots", type=count(0, 65536), default=32)
    ap.add_argument("--provider", default="tcp", help="engine provider between nodes")
    ap.add_argument("--warmup", type=count(0, 1000000), default=3)
    ap.add_argument("--iters", type=count(1, 1000000), default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--launch", choices=["auto", "processes", "threads"], default="auto",
                    help="ranks as processes or as threads of this one; auto: threads where "
                         "CUDA ranks share a GPU, else processes")
    ap.add_argument("--json", help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    # Checked here, before any rank starts: a rank whose AllToAll refused its arguments died
    # with a traceback while the others waited for it in the all-gather, for ever.
    if args.topk > args.experts:
        ap.error(f"--topk {args.topk} is more than --experts {args.experts}")
    if args.experts % args.ranks:
        ap.error(f"--experts {args.experts} do not split evenly over --ranks {args.ranks}")
    if args.ranks_per_node and args.ranks % args.ranks_per_node:
        ap.error(f"--ranks {args.ranks} are not whole nodes of --ranks-per-node "
                 f"{args.ranks_per_node}")
    if args.hidden % 128:
        ap.error(f"--hidden {args.hidden} must be a multiple of 128 (one fp8 scale per 128)")
    import torch
    import torch.multiprocessing as tmp

    launch = args.launch
    if launch == "auto":
        # Processes sharing a GPU have a CUDA context each, and contexts take turns on the GPU
        # (time slices) unless MPS runs: a kernel waiting for a peer's kernel then waits out a
        # slice. 2 ranks on one H200 timed dispatch at ~4.9 ms that way (issue 16).
        shared = args.backend == "cuda" and args.ranks > torch.cuda.device_count()
        launch = "threads" if shared else "processes"
    args.launch = launch
    # The start gate every CUDA rank's layer waits behind: one pinned word; for processes in
    # shared memory, pinned by each of them.
    cuda = args.backend == "cuda"
    gate = torch.zeros(1, dtype=torch.int32)
    gate = gate.pin_memory() if cuda and launch == "threads" else gate.share_memory_()
    got = []
    if launch == "threads":
        group = _Threads(args.ranks)
        errors: List[str] = []

        def run(r: int) -> None:
            try:
                d, c = _rank(r, args, 0, gate, group)
                got.append((r, d, c))
            except BaseException as e:  # reported below; the others fail at the barrier
                errors.append(f"rank {r}: {type(e).__name__}: {e}")
                group.barrier.abort()

        ts = [threading.Thread(target=run, args=(r,)) for r in range(args.ranks)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errors:
            print("\n".join(errors), file=sys.stderr)
            return 1
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = tmp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_process_rank, args=(r, args, port, gate, q), daemon=True)
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        errors = ["interrupted"]
        try:
            got, errors = _collect(procs, q, 600.0)
        finally:
            # After a failure the other ranks wait for the failed one (all-gather, barrier):
            # stopped now, not left running behind this process.
            for p in procs:
                p.join(30 if not errors else 0)
                if p.is_alive():
                    p.kill()
                    p.join(10)
        if errors:
            print("\n".join(errors), file=sys.stderr)
            return 1
    disp = [v for _, d, _ in got for v in d]
    comb = [v for _, _, c in got for v in c]
    rows = {"dispatch": disp, "combine": comb}
    print(f"ferry.moe from Python, {args.backend}: {args.ranks} ranks as {launch} "
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
