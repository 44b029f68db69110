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
