"""Ports for the servers ferry's vLLM tests and benchmarks start on this host
(python/tests/vllm/, scripts/vllm_sweep.py): one owner for how they are picked."""

from __future__ import annotations

import random
import socket

_GIVEN = set()


def reserve(port: int) -> None:
    """Never hand out `port` (a server will bind it: a TP worker's side channel, port + rank)."""
    _GIVEN.add(port)


def free_port() -> int:
    """A port free now, below Linux's ephemeral range (32768-60999 by default): the engines bind
    theirs many seconds later (the side channel once the worker registers its KV cache), and a
    port the kernel handed out as ephemeral was meanwhile taken by one of the engines' own
    sockets once ("handshake server: cannot listen on 127.0.0.1:46735: Address already in use",
    a CI rehearsal of 2026-12-07). Never the same port twice in one process."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 32000)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError("no free port in 20000-31999 after 1000 tries")
