"""One side of a KV transfer for the tests: an engine, a KV pool of torch tensors split the way a
serving engine splits it, and a ferry.kv.KvConnector over them. The parent uses a KvSide
directly; a spawned child runs serve(), which calls KvSide methods on command, so that both
sides of a transfer are real processes.

Pools hold int16 elements (elem_size 2, as bf16 would), poisoned at creation; the prefill side
fills its pool with seeded random values. `gather` reads the KV of a request as a logical
[layers, 2, tokens, heads, head_dim] tensor whatever the split and block size, and
`expected_after` builds what the whole decode pool must hold once a request landed, so every
byte (the written ones and the ones that must stay poison) is checked.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, List, Optional

from peer import SpawnedPeer, command_loop

POISON16 = -0x5455  # 0xABAB as int16: no random fill is likely to leave a run of it intact


class KvSide:
    def __init__(self, provider: str, layout_kw: dict, split: str, *, lease: float = 10.0,
                 op_timeout: float = 5.0, busy_poll: bool = False, device: str = "cpu",
                 pull_keys: str = "offer") -> None:
        import torch

        import ferry
        import ferry.kv as fkv

        self.engine = ferry.TransferEngine(provider, same_host=True, op_timeout=op_timeout,
                                           idle_spin_us=50, busy_poll=busy_poll)
        if split == "vllm-cpu":
            # vLLM 0.32's CPU backend: per layer [num_blocks, heads, block_size, 2 * head_dim],
            # a (block, head) page being block_size K rows then block_size V rows.
            self.layout = fkv.KvLayout(**layout_kw, placement="head-joint", order="HND",
                                       regions="per-layer")
        else:
            self.layout = fkv.KvLayout(**layout_kw, regions=split)
        lay = self.layout
        nb, bs, h, d = lay.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim
        self.split = split
        full = functools.partial(torch.full, fill_value=POISON16, dtype=torch.int16,
                                 device=device)
        if split == "one":
            self.pool: Any = full((lay.num_layers, 2, nb, bs, h, d))
            self.tensors = [self.pool]
        elif split == "vllm-cpu":
            self.pool = [full((nb, h, bs, 2 * d)) for _ in range(lay.num_layers)]
            self.tensors = list(self.pool)
        elif split == "per-layer":  # vLLM: [2, num_blocks, block_size, heads, head_dim] per layer
            self.pool = [full((2, nb, bs, h, d)) for _ in range(lay.num_layers)]
            self.tensors = list(self.pool)
        else:  # SGLang: a K and a V buffer per layer, [num_blocks * block_size, heads, head_dim]
            self.pool = [(full((nb * bs, h, d)), full((nb * bs, h, d)))
                         for _ in range(lay.num_layers)]
            self.tensors = [t for kv in self.pool for t in kv]
        self.conn = fkv.KvConnector(self.engine, lay, self.pool, fkv.KvConfig(lease=lease,
                                                                    pull_keys=pull_keys))
        self.events: List[Any] = []

    # Identity ---------------------------------------------------------------------------------
    def address(self) -> bytes:
        return self.engine.address

    def serve_handshake(self, secret: bytes) -> int:
        import ferry.kv as fkv

        self.handshake = fkv.HandshakeServer(self.conn, secret)
        return self.handshake.port

    def pid(self) -> int:
        return os.getpid()

    # The pool as logical KV -------------------------------------------------------------------
    def slab(self, layer: int, part: int) -> Any:
        """[num_blocks, block_size, heads, head_dim] view of one layer's K (0) or V (1)."""
        lay = self.layout
        shape = (lay.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
        if self.split == "one":
            return self.pool[layer, part]
        if self.split == "per-layer":
            return self.pool[layer][part]
        if self.split == "vllm-cpu":  # [nb, h, 2 * bs, d] as the CPU backend reads it
            t = self.pool[layer].view(lay.num_blocks, lay.num_kv_heads, 2, lay.block_size,
                                      lay.head_dim)
            return t[:, :, part].permute(0, 2, 1, 3)
        return self.pool[layer][part].view(shape)

    def _index(self, blocks: List[int], tokens: int, first_token: int = 0) -> Any:
        """(block, slot) of tokens [first_token, tokens); blocks[0] holds first_token."""
        import torch

        bs = self.layout.block_size
        t = torch.arange(first_token, tokens, device=self.tensors[0].device)
        ids = torch.tensor(blocks, dtype=torch.long, device=t.device)
        return ids[t // bs - first_token // bs], t % bs

    def fill_random(self, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        for t in self.tensors:
            t.copy_(torch.randint(-(1 << 15), 1 << 15, t.shape, generator=g, dtype=torch.int16)
                    .to(t.device))

    def gather(self, blocks: List[int], tokens: int) -> Any:
        """The request's KV as a [layers, 2, tokens, heads, head_dim] tensor."""
        import torch

        blk, slot = self._index(blocks, tokens)
        return torch.stack([torch.stack([self.slab(l, p)[blk, slot] for p in (0, 1)])
                            for l in range(self.layout.num_layers)])

    def expected_after(self, logical: Any, blocks: List[int], tokens: int,
                       first_token: int = 0) -> List[Any]:
        """What every pool tensor must hold after tokens [first_token, tokens) of `logical`
        landed in `blocks` (from first_token's block on) of a poisoned pool."""
        saved = [t.clone() for t in self.tensors]
        try:
            for t in self.tensors:
                t.fill_(POISON16)
            blk, slot = self._index(blocks, tokens, first_token)
            for l in range(self.layout.num_layers):
                for p in (0, 1):
                    self.slab(l, p)[blk, slot] = logical[l, p, first_token:].to(blk.device)
            return [t.clone() for t in self.tensors]
        finally:
            for t, s in zip(self.tensors, saved):
                t.copy_(s)

    def check_pool(self, expected: List[Any]) -> str:
        """'' when every byte is as expected, else where the first difference is."""
        for i, (got, want) in enumerate(zip(self.tensors, expected)):
            bad = (got != want).nonzero()
            if bad.numel():
                at = tuple(bad[0].tolist())
                return (f"pool tensor {i}: {bad.shape[0]} elements differ, first at {at}: got "
                        f"{int(got[at])}, want {int(want[at])}")
        return ""

    def all_poison(self) -> bool:
        return all(bool((t == POISON16).all()) for t in self.tensors)

    # Connector --------------------------------------------------------------------------------
    def call(self, method: str, *args: Any, **kw: Any) -> Any:
        return getattr(self.conn, method)(*args, **kw)

    def offer_pull_under(self, transfer_id: Any, blocks: List[int], tokens: int,
                         capability: bytes) -> bytes:
        return self.conn.offer_pull(transfer_id, blocks, tokens, capability=capability)

    def next_event(self, kind: str, transfer_id: Any, timeout: float) -> Any:
        """The first event of `kind` for `transfer_id` (as the calls named it: an int, str or
        bytes), as (ok, code, message, bytes, writes); events of other kinds or transfers are
        kept for later calls."""
        deadline = time.monotonic() + timeout
        while True:
            self.events.extend(self.conn.poll())
            for i, e in enumerate(self.events):
                if e.kind == kind and e.request_id == transfer_id:
                    del self.events[i]
                    return e.ok, e.code, e.message, e.bytes, e.writes
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {kind} event for transfer {transfer_id} within "
                                   f"{timeout} s (events: {self.events})")
            self.conn.wait(min(left, 0.5))

    def stats(self) -> dict:
        return self.conn.stats()

    def close(self) -> None:
        if getattr(self, "handshake", None) is not None:
            self.handshake.close()
        self.conn.close()
        self.engine.close()


def serve(conn: Any) -> None:
    """Runs KvSide commands from the parent: ("open", provider, layout_kw, split, kwargs) or
    (KvSide method name, args...)."""
    side: List[Optional[KvSide]] = [None]

    def handle(cmd: str, args: list) -> Any:
        if cmd == "open":
            if side[0] is not None:
                side[0].close()
            side[0] = KvSide(args[0], args[1], args[2], **args[3])
            return side[0].address()
        if cmd == "gather":
            return side[0].gather(*args).cpu().numpy()
        return getattr(side[0], cmd)(*args)

    command_loop(conn, handle)
    if side[0] is not None:
        side[0].close()


class KvPeer(SpawnedPeer):
    """The parent's handle on a spawned KvSide process."""

    def __init__(self) -> None:
        super().__init__(serve)

    def call(self, *cmd: Any, timeout: float = 60.0) -> Any:
        return super().call(*cmd, timeout=timeout)
