"""A peer process for the tests: owns a TransferEngine and answers commands over a pipe.

Spawned (never forked: ferry's engines own threads and fabric resources), so each test talks to
a real second process. Every reply is ("ok", value) or ("err", class name, message).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any, Callable

import numpy as np

POISON = 0xAB


def _make_buffer(kind: str, nbytes: int, fill: int) -> Any:
    if kind == "numpy":
        return np.full(nbytes, fill, dtype=np.uint8)
    if kind == "bytearray":
        return bytearray([fill]) * nbytes
    if kind in ("torch", "torch-cuda"):
        import torch  # only the tests that use tensors pay for the import

        device = "cuda" if kind == "torch-cuda" else "cpu"
        # A multi-byte dtype on purpose: regions are bytes whatever the element type.
        t = torch.full((nbytes // 4,), 0, dtype=torch.int32, device=device)
        t.view(torch.uint8).fill_(fill)
        return t
    raise ValueError(f"unknown buffer kind {kind}")


def _to_bytes(buf: Any) -> bytes:
    if isinstance(buf, np.ndarray):
        return buf.tobytes()
    if isinstance(buf, bytearray):
        return bytes(buf)
    return buf.view(-1).cpu().numpy().tobytes()


def _set_bytes(buf: Any, data: bytes) -> None:
    if isinstance(buf, np.ndarray):
        buf[:] = np.frombuffer(data, dtype=np.uint8)
    elif isinstance(buf, bytearray):
        buf[:] = data
    else:
        import torch

        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buf.view(torch.uint8).copy_(src.to(buf.device))


def command_loop(conn: Any, handle: Callable[[str, list], Any]) -> None:
    """Answers the parent's commands with handle(cmd, args) until ("exit",), a closed pipe or
    300 s (a parent that vanished must not leave us behind). Replies ("ok", value) or ("err",
    class name, message)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if not conn.poll(1.0):
            continue
        try:
            cmd, *args = conn.recv()
        except EOFError:
            break
        if cmd == "exit":
            conn.send(("ok", None))
            break
        try:
            result = handle(cmd, args)
            conn.send(("ok", result))
        except Exception as e:  # reported to the parent, which fails the test with it
            conn.send(("err", type(e).__name__, str(e)))


def serve(conn: Any, provider: str, op_timeout: float) -> None:
    import ferry

    engine = ferry.TransferEngine(provider, same_host=True, op_timeout=op_timeout,
                                  idle_spin_us=50)
    buffers: dict = {}
    regions: dict = {}
    peers: dict = {}
    expectations: dict = {}
    conn.send(("ok", engine.address))

    def handle(cmd: str, args: list) -> Any:
        if cmd == "connect":
            peers[args[0]] = engine.connect(args[1])
            return int(peers[args[0]])
        if cmd == "alloc":
            name, kind, nbytes, fill = args
            buffers[name] = _make_buffer(kind, nbytes, fill)
            regions[name] = engine.register(buffers[name])
            return regions[name].descriptor
        if cmd == "get":
            return _to_bytes(buffers[args[0]])
        if cmd == "set":
            return _set_bytes(buffers[args[0]], args[1])
        if cmd == "wait_imm":
            imm, count, timeout = args
            return engine.wait_imm(imm, count, timeout)
        if cmd == "expect_imm":
            expectations[args[0]] = engine.expect_imm(args[0], args[1], args[2])
            return None
        if cmd == "expectation_done":
            return expectations[args[0]].done()
        if cmd == "write":
            # write(peer name, src region name, src_offset, dst descriptor, dst_offset, n, imm)
            peer, src, so, dst, do, n, imm = args
            op = engine.write(peers[peer], regions[src], so, dst, do, n, imm=imm)
            op.wait(10.0)
            return op.imm_writes
        if cmd == "pid":
            return os.getpid()
        raise ValueError(f"unknown command {cmd}")

    command_loop(conn, handle)
    engine.close()


class SpawnedPeer:
    """The parent's handle on a spawned process running target(conn, *args), which answers each
    command sent over the pipe with ("ok", value) or ("err", class name, message)."""

    def __init__(self, target: Any, args: tuple = ()) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()

    def call_timeout(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise RuntimeError(f"peer process did not answer within {timeout} s")
        reply = self._conn.recv()
        if reply[0] == "err":
            raise RuntimeError(f"peer process: {reply[1]}: {reply[2]}")
        return reply[1]

    def call(self, *cmd: Any, timeout: float = 30.0) -> Any:
        self._conn.send(cmd)
        return self.call_timeout(timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10.0)
            except (RuntimeError, OSError, EOFError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


class PeerProcess(SpawnedPeer):
    """A spawned engine peer (serve above); its engine address is ready once constructed."""

    def __init__(self, provider: str, op_timeout: float = 5.0) -> None:
        super().__init__(serve, (provider, op_timeout))
        self.address = self.call_timeout(60.0)
