"""A small expert-parallel MoE layer on ferry.moe: router, dispatch, expert matmuls in torch,
combine, at world 2 on CPU (two spawned processes meeting through torch.distributed / gloo),
checked against a dense single-process torch reference.

    PYTHONPATH=build/python python3 examples/python/moe_layer.py [--fp8] [--tokens N]

Each rank routes its own tokens (softmax over the router's logits, top-k, weights renormalized),
dispatches them to the ranks holding their experts, runs its local experts (SiLU MLPs) on the
rows it received, and combines the weighted results back. The reference runs every expert on
every token in one process; the printed max error is what bf16 (and fp8) rounding costs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

import ferry.moe

HIDDEN, FFN, EXPERTS, TOPK, WORLD = 256, 512, 8, 2, 2


def weights(seed: int):
    """The layer's parameters, the same on every rank (each uses its experts' slices)."""
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(HIDDEN, EXPERTS, generator=g) / HIDDEN ** 0.5
    w1 = torch.randn(EXPERTS, HIDDEN, FFN, generator=g) / HIDDEN ** 0.5
    w2 = torch.randn(EXPERTS, FFN, HIDDEN, generator=g) / FFN ** 0.5
    return router, w1.to(torch.bfloat16), w2.to(torch.bfloat16)


def route(x: torch.Tensor, router: torch.Tensor):
    probs = torch.softmax(x.float() @ router, dim=-1)
    w, idx = probs.topk(TOPK, dim=-1)
    return idx, (w / w.sum(dim=-1, keepdim=True)).float()


def expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(x.float() @ w1.float()) @ w2.float()).to(torch.bfloat16)


def tokens_of(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(100 + rank)).to(
        torch.bfloat16)


def rank_main(rank: int, port: int, n: int, fp8: bool, seed: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    router, w1, w2 = weights(seed)
    dt = ferry.moe.fp8_dtype() if fp8 else torch.bfloat16
    a2a = ferry.moe.AllToAll(
        max_num_tokens=n, num_experts=EXPERTS, expert_padding=1, hidden_dim=HIDDEN,
        hidden_dim_scale=HIDDEN // 128 if fp8 else None, in_dtype=dt, out_dtype=torch.bfloat16,
        scale_dtype=torch.float32 if fp8 else None,
        num_experts_per_token=TOPK, device="cpu", provider="tcp")
    nl = a2a.num_local_experts
    x = tokens_of(rank, n)
    idx, w = route(x, router)

    count = torch.zeros(nl, dtype=torch.int32)
    recv = torch.zeros(nl, a2a.max_recv_tokens, HIDDEN, dtype=torch.bfloat16)
    recv_scale = None
    if fp8:
        q, s = ferry.moe.quantize_fp8(x)
        recv = torch.zeros(nl, a2a.max_recv_tokens, HIDDEN, dtype=torch.uint8).view(dt)
        recv_scale = torch.zeros(nl, a2a.max_recv_tokens, HIDDEN // 128, dtype=torch.float32)
        a2a.dispatch(count, recv, recv_scale, q, s, idx, w)
    else:
        a2a.dispatch(count, recv, None, x, None, idx, w)

    y = torch.zeros(nl, a2a.max_recv_tokens, HIDDEN, dtype=torch.bfloat16)
    for le in range(nl):
        m = int(count[le])
        if m == 0:
            continue
        rows = ferry.moe.dequantize_fp8(recv[le, :m], recv_scale[le, :m]) if fp8 else recv[le, :m]
        e = rank * nl + le
        y[le, :m] = expert(rows, w1[e], w2[e])
    out = torch.zeros(n, HIDDEN, dtype=torch.float32)
    a2a.combine(out, idx, w, y)

    # Dense reference: every expert on every token, weighted by the same routing.
    ref = torch.zeros(n, HIDDEN, dtype=torch.float32)
    seen = ferry.moe.dequantize_fp8(*ferry.moe.quantize_fp8(x)) if fp8 else x
    for e in range(EXPERTS):
        ye = expert(seen, w1[e], w2[e]).float()
        for k in range(TOPK):
            ref += torch.where(idx[:, k:k + 1] == e, w[:, k:k + 1] * ye, torch.zeros_like(ye))
    vs_x = torch.zeros(n, HIDDEN)
    if fp8:  # how far fp8 dispatch takes the layer from bf16 inputs
        for e in range(EXPERTS):
            ye = expert(x, w1[e], w2[e]).float()
            for k in range(TOPK):
                vs_x += torch.where(idx[:, k:k + 1] == e, w[:, k:k + 1] * ye,
                                    torch.zeros_like(ye))
    err = (out - ref).abs().max().item()
    msg = f"rank {rank}: {n} tokens, {int(count.sum())} rows received, max error vs dense " \
          f"reference {err:.3g}"
    if fp8:
        msg += f" (fp8 vs bf16 inputs: {(out - vs_x).abs().max().item():.3g})"
    print(msg, flush=True)
    a2a.close()
    dist.destroy_process_group()
    if err > 1e-4:
        raise SystemExit(f"rank {rank}: error {err} above 1e-4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--fp8", action="store_true", help="dispatch fp8 (one scale per 128)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp.spawn(rank_main, args=(port, args.tokens, args.fp8, args.seed), nprocs=WORLD)


if __name__ == "__main__":
    main()
