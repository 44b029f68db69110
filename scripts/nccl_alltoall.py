#!/usr/bin/env python3
"""The baseline a user already has for MoE dispatch/combine: NCCL all_to_all_single.

Times, per rank, an all_to_all_single moving the same bytes as `ferry bench moe --backend cuda`
with the same shape: dispatch sends each token once to every rank holding one of its top-k
experts (fp8 payload + one fp32 scale per 128 channels, or bf16), combine sends one bf16 row per
(token, expert) back. Routing is uniform random top-k, like the ferry benchmark. Split sizes
are exchanged before timing (ferry exchanges its counts inside the timed call, so this favours
NCCL slightly). Timed with CUDA events after warm-up; prints median and p99 in microseconds.

    python3 scripts/nccl_alltoall.py --ranks 2 --tokens 128   # decode shape
    python3 scripts/nccl_alltoall.py --ranks 2 --tokens 4096  # prefill shape

NCCL_NVLS_ENABLE=0 is forced: NVLink SHARP (multicast) is not to be used on these machines.
"""
import argparse
import json
import os
import statistics

os.environ["NCCL_NVLS_ENABLE"] = "0"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def percentile(values, p):
    v = sorted(values)
    i = max(0, min(len(v) - 1, int(-(-p * len(v) // 1)) - 1))
    return v[i]


def splits_for(args, rank, world):
    """Bytes this rank sends to each rank in dispatch and in combine."""
    g = torch.Generator().manual_seed(args.seed * 7919 + rank)
    scores = torch.rand(args.tokens, args.experts, generator=g)
    idx = scores.topk(args.topk, dim=1).indices  # distinct experts per token
    owner = idx // (args.experts // world)
    elem = 1 if args.dtype == "fp8" else 2
    scales = 4 * (args.hidden // 128) if args.dtype == "fp8" else 0
    row = args.hidden * elem + scales
    disp, comb = [], []
    for d in range(world):
        hits = (owner == d)
        disp.append(int(hits.any(dim=1).sum()) * row)
        comb.append(int(hits.sum()) * args.hidden * 2)
    return disp, comb


def time_alltoall(send_splits, recv_splits, args, device):
    send = torch.empty(sum(send_splits), dtype=torch.uint8, device=device)
    recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=device)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    samples = []
    for it in range(args.warmup + args.iters):
        torch.cuda.synchronize(device)
        dist.barrier()
        start.record()
        dist.all_to_all_single(recv, send, recv_splits, send_splits)
        end.record()
        end.synchronize()
        if it >= args.warmup:
            samples.append(start.elapsed_time(end) * 1e3)
    return samples


def worker(rank, world, args, queue):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    disp, comb = splits_for(args, rank, world)
    # Everyone's send splits -> this rank's receive splits.
    mine = torch.tensor(disp + comb, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    disp_in = [int(everyone[s][rank]) for s in range(world)]
    comb_in = [int(everyone[s][world + rank]) for s in range(world)]
    # Combine runs the reverse direction of dispatch: results go back to the token's rank.
    d = time_alltoall(disp, disp_in, args, device)
    c = time_alltoall(comb, comb_in, args, device)
    queue.put((rank, d, c, sum(disp), sum(comb)))
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.ranks, args, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise SystemExit(f"rank process exited with {p.exitcode}")
    disp = [s for r in results for s in r[1]]
    comb = [s for r in results for s in r[2]]
    disp_bytes = sum(r[3] for r in results)
    comb_bytes = sum(r[4] for r in results)
    out = {
        "command": "scripts/nccl_alltoall.py",
        "ranks": args.ranks, "tokens": args.tokens, "hidden": args.hidden, "topk": args.topk,
        "experts": args.experts, "dtype": args.dtype, "iters": args.iters,
        "dispatch": {"p50_us": statistics.median(disp), "p99_us": percentile(disp, 0.99)},
        "combine": {"p50_us": statistics.median(comb), "p99_us": percentile(comb, 0.99)},
        "dispatch_bytes": disp_bytes, "combine_bytes": comb_bytes,
    }
    print(f"nccl all_to_all_single, {args.ranks} ranks, {args.tokens} tokens/rank, hidden "
          f"{args.hidden}, top-{args.topk} of {args.experts}, {args.dtype} dispatch, "
          f"{args.iters} iterations after {args.warmup} warm-up (NCCL_NVLS_ENABLE=0)")
    for name, key, nbytes in (("dispatch", "dispatch", disp_bytes),
                              ("combine", "combine", comb_bytes)):
        p50 = out[key]["p50_us"]
        print(f"{name:<9} p50 {p50:9.1f} us  p99 {out[key]['p99_us']:9.1f} us  "
              f"bytes/call all ranks {nbytes}  per rank {nbytes / args.ranks / (p50 * 1e3):.1f} "
              f"GB/s at p50")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
