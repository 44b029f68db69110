"""CUDA tensors between two processes on one GPU (CUDA IPC), over shm and tcp. Skipped, with
the reason printed, where torch sees no GPU or ferry was built without CUDA; run on a GPU
machine by scripts/gpu_check.sh."""

from __future__ import annotations

import numpy as np
import pytest

import ferry
from peer import POISON, PeerProcess


def cuda_torch():
    try:
        import torch
    except ImportError as e:
        reason = f"torch not importable: {e}"
    else:
        if torch.cuda.is_available() and ferry.gpu_device_count() > 0:
            return torch
        reason = (f"no GPU: torch.cuda.is_available()={torch.cuda.is_available()}, "
                  f"ferry.gpu_device_count()={ferry.gpu_device_count()}")
    print(f"skipping GPU tests: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module", params=["shm", "tcp"])
def gpu_pair(request):
    torch = cuda_torch()
    child = PeerProcess(request.param)
    engine = ferry.TransferEngine(request.param, same_host=True, op_timeout=5.0)
    peer = engine.connect(child.address)
    child.call("connect", "parent", engine.address)
    yield torch, engine, peer, child
    child.close()
    engine.close()


def test_cuda_tensor_write_and_read(gpu_pair, rng):
    torch, engine, peer, child = gpu_pair
    size = 1 << 20
    data = np.frombuffer(rng.randbytes(size), dtype=np.uint8).copy()
    src = torch.from_numpy(data).cuda()
    region = engine.register(src)
    assert region.device == src.device.index
    desc = child.call("alloc", "gpu", "torch-cuda", size, POISON)
    n = rng.randint(1, size // 2)
    off = rng.randrange(0, size - n + 1)
    op = engine.write(peer, region, 0, desc, off, n, imm=5)
    op.wait(10.0)
    child.call("wait_imm", 5, op.imm_writes, 10.0)
    got = np.frombuffer(child.call("get", "gpu"), dtype=np.uint8)
    want = np.full(size, POISON, dtype=np.uint8)
    want[off:off + n] = data[:n]
    assert (got == want).all()

    back = torch.full((size,), POISON, dtype=torch.uint8, device="cuda")
    engine.read(peer, engine.register(back), 0, desc, off, n).wait(10.0)
    torch.cuda.synchronize()
    out = back.cpu().numpy()
    assert (out[:n] == data[:n]).all() and (out[n:] == POISON).all()


def test_cuda_tensor_paged_write(gpu_pair, rng):
    torch, engine, peer, child = gpu_pair
    page, pages = 16 << 10, 32
    data = np.frombuffer(rng.randbytes(page * pages), dtype=np.uint8).copy()
    src = torch.from_numpy(data).cuda()
    region = engine.register(src)
    desc = child.call("alloc", "gpu-paged", "torch-cuda", page * pages, POISON)
    sp = rng.sample(range(pages), 12)
    dp = rng.sample(range(pages), 12)
    op = engine.paged_write(peer, region, torch.tensor(sp), page, desc, dp, page, page, imm=6)
    op.wait(10.0)
    child.call("wait_imm", 6, op.imm_writes, 10.0)
    got = np.frombuffer(child.call("get", "gpu-paged"), dtype=np.uint8)
    want = np.full(page * pages, POISON, dtype=np.uint8)
    for s, d in zip(sp, dp):
        want[d * page:(d + 1) * page] = data[s * page:(s + 1) * page]
    assert (got == want).all()
