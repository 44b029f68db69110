"""A KV push between two processes: a prefill process with one torch tensor per layer (vLLM's
[2, num_blocks, block_size, heads, head_dim]) and a decode process with a K and a V buffer per
layer (SGLang's), with different block sizes. Decode registers its blocks, prefill reports its
KV done, ferry writes it from prefill's pool into decode's; decode checks every byte.

    python3 examples/python/kv_push.py [tcp|shm]
"""

import multiprocessing as mp
import sys
import time

import torch

import ferry
import ferry.kv as fkv

LAYERS, HEADS, HEAD_DIM, TOKENS = 4, 2, 64, 200
PREFILL = fkv.KvLayout(LAYERS, HEADS, HEAD_DIM, elem_size=2, block_size=16, num_blocks=16,
                       regions="per-layer")
DECODE = fkv.KvLayout(LAYERS, HEADS, HEAD_DIM, elem_size=2, block_size=32, num_blocks=8,
                      regions="per-layer-kv")
TRANSFER_ID = 42


def prefill_kv() -> torch.Tensor:
    """The prompt's KV, [layers, 2, tokens, heads, head_dim], the same in both processes."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(LAYERS, 2, TOKENS, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)


def next_event(conn: fkv.KvConnector, kind: str, timeout: float) -> fkv.KvEvent:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in conn.poll():  # a serving engine calls poll() once per step
            if e.kind == kind and e.transfer_id == TRANSFER_ID:
                return e
        conn.wait(0.1)
    raise TimeoutError(f"no {kind} event within {timeout} s")


def prefill(provider: str, pipe) -> None:
    with ferry.TransferEngine(provider, same_host=True) as engine:
        shape = (2, PREFILL.num_blocks, PREFILL.block_size, HEADS, HEAD_DIM)
        pool = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
        blocks = [5, 2, 9, 11, 0, 7, 3, 14, 1, 8, 12, 4, 6]  # 13 blocks of 16 hold 200 tokens
        kv = prefill_kv()
        for t in range(TOKENS):  # "compute" the KV into the paged pool
            for layer in range(LAYERS):
                pool[layer][:, blocks[t // 16], t % 16] = kv[layer, :, t]
        with fkv.KvConnector(engine, PREFILL, pool) as conn:
            pipe.send(engine.address)
            pipe.recv()  # decode registered
            conn.prefill_done(TRANSFER_ID, blocks, TOKENS)
            sent = next_event(conn, "send", 30)
            sent.raise_if_error()  # the blocks are free again
            pipe.send(sent.bytes)


def main() -> int:
    provider = sys.argv[1] if len(sys.argv) > 1 else "tcp"
    ctx = mp.get_context("spawn")  # engines own threads: never fork a process that has one
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=prefill, args=(provider, theirs))
    child.start()
    try:
        with ferry.TransferEngine(provider, same_host=True) as engine:
            rows = DECODE.num_blocks * DECODE.block_size
            kv_bufs = [(torch.full((rows, HEADS, HEAD_DIM), -1.0, dtype=torch.bfloat16),
                        torch.full((rows, HEADS, HEAD_DIM), -1.0, dtype=torch.bfloat16))
                       for _ in range(LAYERS)]
            blocks = [6, 1, 3, 0, 7, 2, 4]  # 7 blocks of 32 hold 200 tokens
            with fkv.KvConnector(engine, DECODE, kv_bufs) as conn:
                if not ours.poll(60):
                    raise TimeoutError("the prefill process did not start")
                conn.register_push(TRANSFER_ID, 1, [ours.recv()], blocks, TOKENS)
                ours.send("registered")
                done = next_event(conn, "recv", 30)
                done.raise_if_error()
                want = prefill_kv()
                slot = torch.tensor([blocks[t // 32] * 32 + t % 32 for t in range(TOKENS)])
                for layer, (k, v) in enumerate(kv_bufs):
                    if not (torch.equal(k[slot], want[layer, 0])
                            and torch.equal(v[slot], want[layer, 1])):
                        print(f"kv_push: layer {layer} differs", file=sys.stderr)
                        return 1
                if not ours.poll(30):
                    raise TimeoutError("the prefill process did not report its send")
                sent = ours.recv()
                print(f"kv_push.py: {done.bytes} KV bytes of {TOKENS} tokens pushed over "
                      f"{engine.provider} (prefill sent {sent}), per-layer tensors to K/V "
                      f"buffers, 16- to 32-token blocks: OK")
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
