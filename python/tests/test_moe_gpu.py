"""ferry.moe on a GPU: world 2 with both ranks on GPU 0 as processes (CUDA IPC between them),
fp8 dispatch and bf16 combine, a captured CUDA graph replayed over many calls, every call's
results equal to the CPU backend's on the same inputs (moe_worker.py GPU_SCENARIOS). Skipped,
with the reason printed, without a GPU; run on a GPU machine by scripts/gpu_check.sh."""

from __future__ import annotations

import os
import random

import pytest

import ferry
import moe_worker
from test_moe import run_worlds


def _gpu_or_skip():
    try:
        import torch
    except ImportError as e:
        reason = f"torch not importable: {e}"
    else:
        if torch.cuda.is_available() and ferry.gpu_device_count() > 0:
            return
        reason = (f"no GPU: torch.cuda.is_available()={torch.cuda.is_available()}, "
                  f"ferry.gpu_device_count()={ferry.gpu_device_count()}")
    print(f"skipping MoE GPU tests: {reason}")
    pytest.skip(reason)


CONFIG = (2, 2, "tcp", "allgather")


@pytest.fixture(scope="module")
def gpu_results():
    _gpu_or_skip()
    seed = int(os.environ.get("FERRY_TEST_SEED", random.randrange(1 << 31)))
    print(f"moe gpu: seed {seed}")
    res = run_worlds([CONFIG], seed, list(moe_worker.GPU_SCENARIOS), deadline_s=170.0)
    return res[CONFIG], seed


@pytest.mark.parametrize("scenario", list(moe_worker.GPU_SCENARIOS))
def test_moe_gpu(gpu_results, scenario):
    per_rank, seed = gpu_results
    assert sorted(per_rank) == [0, 1], f"ranks missing (seed {seed}): {sorted(per_rank)}"
    for r, per in sorted(per_rank.items()):
        assert "setup" not in per, f"rank {r} setup failed (seed {seed}):\n{per['setup']}"
        assert scenario in per, f"rank {r} did not get to {scenario} (an earlier one failed)"
        assert per[scenario] is None, f"rank {r}, {scenario}, seed {seed}:\n{per[scenario]}"


def test_fp32_flat_async_on_cuda():
    """pplx-garden's fp32 pairing on the CUDA path, world of one: dispatch_async into a flat
    out_expert_x, combine_async of a flat expert_y, and the combine within fp32 accumulation's
    error of the float64 sum (each value carried as three bf16 pieces)."""
    _gpu_or_skip()
    import torch

    T, H, E, K = 6, 256, 4, 2
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(T, H, generator=g) * torch.logspace(-3, 3, H)).cuda()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g)
    with ferry.moe.AllToAll(8, E, 1, H, None, torch.float32, torch.float32, None, K,
                            device="cuda", rank=0, world_size=1,
                            allgather=lambda b: [b]) as a:
        n = torch.zeros(E, dtype=torch.int32, device="cuda")
        ox = torch.full((a.max_recv_tokens_flat, H), float("nan"), device="cuda")
        h = a.dispatch_async(out_expert_num_tokens=n, out_expert_x=ox, out_expert_x_scale=None,
                             dp_x=x, dp_x_scale=None, indices=idx.cuda(), weights=w.cuda())
        h.recv()
        counts, row, starts = n.tolist(), 0, []
        for e in range(E):
            starts.append(row)
            want = [t for t in range(T) for j in range(K) if int(idx[t, j]) == e]
            assert counts[e] == len(want)
            assert torch.equal(ox[row:row + counts[e]].cpu(), x[want].cpu()), f"expert {e}"
            row += counts[e]
        y = ox * 3 - 1
        out = torch.zeros(T, H, device="cuda")
        a.combine_async(out_tokens=out, dispatch_handle=h, expert_y=y).recv()
        a.synchronize()
    ref = torch.zeros(T, H, dtype=torch.float64)
    mag = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            term = float(w[t, j]) * (x[t].cpu() * 3 - 1).double()
            ref[t] += term
            mag[t] += term.abs()
    err = (out.cpu().double() - ref).abs()
    assert bool((err <= (K + 2) * 2.0**-24 * mag).all()), float((err / mag).max())
