"""ferry.kv with CUDA tensor pools: a prefill process and the decode test process on one GPU
(CUDA IPC), push and pull, every byte of the decode pool checked as in test_kv.py. Skipped, with
the reason printed, where torch sees no GPU or ferry was built without CUDA; run on a GPU
machine by scripts/gpu_check.sh."""

from __future__ import annotations

import pytest

from kv_worker import KvPeer, KvSide
from test_gpu import cuda_torch
from test_kv import DECODE, PREFILL, SPLITS, TOKENS, assert_landed, blocks_for


@pytest.fixture(scope="module", params=["shm", "tcp"])
def gpu_sides(request):
    torch = cuda_torch()
    provider = request.param
    peer = KvPeer()
    addr = peer.call("open", provider, PREFILL, SPLITS[0][0], {"device": "cuda"})
    decode = KvSide(provider, DECODE, SPLITS[0][1], device="cuda")
    yield torch, peer, addr, decode
    decode.close()
    peer.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_cuda_pools(gpu_sides, rng, mode):
    torch, peer, addr, decode = gpu_sides
    peer.call("fill_random", rng.randrange(1 << 31))
    for t in decode.tensors:
        t.fill_(-0x5455)
    pblocks = blocks_for(rng, PREFILL["num_blocks"], PREFILL["block_size"], TOKENS)
    dblocks = blocks_for(rng, DECODE["num_blocks"], DECODE["block_size"], TOKENS)
    logical = torch.from_numpy(peer.call("gather", pblocks, TOKENS))
    tid = rng.randrange(1 << 63)
    if mode == "push":
        decode.call("register_push", tid, 1, [addr], dblocks, TOKENS)
        peer.call("call", "prefill_done", tid, pblocks, TOKENS)
    else:
        params = peer.call("call", "offer_pull", tid, pblocks, TOKENS)
        decode.call("pull", tid, [params], dblocks, TOKENS)
    ok, code, msg, _, _ = decode.next_event("recv", tid, 30)
    assert ok, f"{code}: {msg}"
    assert peer.call("next_event", "send", tid, 30)[0]
    torch.cuda.synchronize()
    assert_landed(decode, dblocks, logical)
