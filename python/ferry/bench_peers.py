"""ferry beside NIXL and Mooncake's TransferEngine: the same transfers, same host, same run.

    python3 -m ferry.bench_peers [--quick] [--json FILE] [--peers nixl,mooncake,uccl]
                                 [--transports shm,tcp,shm-cma] [--rounds 5] [--list]

Every library sits behind one small adapter with the same calls: register a host buffer (and
hand the peer what it needs to write into it), prepare a transfer from descriptor lists
(source offsets, destination offsets, lengths), post it and wait for the library to report it
complete. Each configuration (library, transport) runs as two spawned processes, kept for the
whole run; only the pair being measured runs, the others are stopped (SIGSTOP), so an idle
progress thread takes no CPU from the measured pair. The patterns:

  bw    one write of 64 KiB, 1 MiB, 16 MiB, 256 MiB; GB/s over back-to-back writes.
  lat   64 B and 4 KiB: one-way latency, half a ping-pong, p50 and p99; each side learns of
        the other's write through the library's notification where it has one for a single
        write (ferry: an immediate, wait_imm), else by polling the write's last byte.
  rate  64 B and 4 KiB, 1 and 64 descriptors per request, 8 requests in flight: descriptors/s.
  kv    the KV shape of Qwen3-32B at TP 8 per rank: 64 layers, K and V, one KV head of 128,
        bf16, 16k tokens in blocks of 16 tokens (131,072 descriptors of 4 KiB) and of 128
        tokens (16,384 of 32 KiB), block ids random on both sides. Preparation: from the block
        ids to the post call's return (descriptor lists, handles); transfer: from the post
        call to the library's completion.
  --transports cuda: the buffers are CUDA memory on cuda:0 (both processes of a pair on the
  one GPU), ferry's CUDA IPC path beside NIXL's UCX cuda_ipc; bw and kv only.
  Every clock stops at the target's confirmation: Mooncake's at its target's ack, ferry's at
  its target's answer once it counted the writes' immediates (FerryAdapter); on cuda, where a
  completed copy is in the target's GPU memory, ferry's at Op.wait and NIXL's at DONE.

Per point, ferry and the peers alternate (their order flips every round) for --rounds rounds;
the report gives each library's median and, per pairing, the median of the per-round ratios
with its quartiles, oriented so that above 1 means ferry is better. Pairings: ferry shm with
NIXL over UCX's shared-memory transports (UCX_TLS=sm: posix/sysv mappings and CMA, where
libfabric's shm provider uses its own mappings and CMA), ferry tcp with NIXL over UCX tcp and
with Mooncake's tcp transport; `--transports shm-cma`: ferry on shm with cma_writes (a write
copied by process_vm_writev on the caller's thread, as UCX's cma puts are) beside NIXL's sm,
and with "shm" in the same run, beside ferry's plain shm. A peer that is not installed or
cannot run here is skipped with a line saying why and how to install it
(scripts/peers_venv.sh).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ._bench import count, percentile, write_json
from ._bench import seconds as seconds_flag

KiB, MiB = 1 << 10, 1 << 20
INSTALL = ("bash scripts/peers_venv.sh (makes build/peers-venv with the peers of "
           "requirements/peers.txt and ferry), then build/peers-venv/bin/python3 -m "
           "ferry.bench_peers")
# What each configuration is: (library, transport) -> how the adapter is made.
CONFIGS = {
    "ferry-shm": ("ferry", "shm"),
    "ferry-shm-cma": ("ferry", "shm-cma"),
    "ferry-shm-cma-wait": ("ferry", "shm-cma-wait"),
    "ferry-tcp": ("ferry", "tcp"),
    "ferry-shm-iov1": ("ferry", "shm-iov1"),
    "ferry-tcp-iov1": ("ferry", "tcp-iov1"),
    "ferry-shm-rails4": ("ferry", "shm-rails4"),
    "ferry-tcp-rails4": ("ferry", "tcp-rails4"),
    "nixl-ucx-sm": ("nixl", "sm"),
    "nixl-ucx-tcp": ("nixl", "tcp"),
    "nixl-libfabric": ("nixl", "libfabric"),
    "mooncake-tcp": ("mooncake", "tcp"),
    "uccl-p2p": ("uccl", "p2p"),
    "ferry-cuda": ("ferry", "cuda"),
    "nixl-ucx-cuda": ("nixl", "cuda"),
}
# Configurations whose buffers are CUDA memory (torch tensors on cuda:0): both processes of a
# pair on the one GPU, writes GPU to GPU through CUDA IPC (ferry's same-host GPU path, UCX's
# cuda_ipc). Only "bw" and "kv" there: "lat" and "rate" poll or fill host bytes.
CUDA_CONFIGS = {"ferry-cuda", "nixl-ucx-cuda"}
CUDA_PATTERNS = ("bw", "kv")
# ferry's configuration on a transport, and the peers' configurations it is compared with.
# "shm-cma": ferry on shm with cma_writes (its writes copied by process_vm_writev, as UCX's cma
# puts are), beside NIXL's sm and, in a run with "shm" too, beside ferry's plain shm.
# "shm-cma-wait": the same, its clock stopping at Op.wait, when the bytes are in the target's
# memory (process_vm_writev returned), where NIXL's clock stops, instead of at the target's
# answer (FerryAdapter).
# "shm-iov1", "tcp-iov1": ferry with rma_iovs=1, one fabric operation per run of pages (as
# before 2026-12-07), to measure what joining up to 4 runs per operation does, in one run.
# "shm-rails4", "tcp-rails4": ferry with 4 rails (4 endpoints, each with its worker thread; on
# tcp 4 connections to the peer): writes above stripe_threshold (1 MiB) are split over them, as
# UCX's tcp spreads a large put over its lanes, and a paged write's operations rotate over them,
# so that on a host with cores to spare 4 workers on each side copy at once.
PAIRINGS = {"shm": ("ferry-shm", ["nixl-ucx-sm", "nixl-libfabric"]),
            "tcp": ("ferry-tcp", ["nixl-ucx-tcp", "mooncake-tcp", "uccl-p2p"]),
            "shm-cma": ("ferry-shm-cma", ["nixl-ucx-sm", "nixl-libfabric"]),
            "shm-cma-wait": ("ferry-shm-cma-wait", ["nixl-ucx-sm", "nixl-libfabric"]),
            "cuda": ("ferry-cuda", ["nixl-ucx-cuda"]),
            "shm-iov1": ("ferry-shm-iov1", ["nixl-ucx-sm"]),
            "tcp-iov1": ("ferry-tcp-iov1", ["nixl-ucx-tcp"]),
            "shm-rails4": ("ferry-shm-rails4", ["nixl-ucx-sm"]),
            "tcp-rails4": ("ferry-tcp-rails4", ["nixl-ucx-tcp", "mooncake-tcp"])}
DEFAULT_TRANSPORTS = ["shm", "tcp"]
PEERS = {"nixl": ("nixl", "pip install nixl-cu12==1.5.1 nixl-cu13==1.5.1 nixl==1.5.1 --no-deps"),
         "mooncake": ("mooncake.engine",
                      "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 --no-deps"),
         "uccl": ("uccl.p2p", "pip install uccl==0.1.1 (Python >= 3.12, a CUDA driver)")}
WINDOW = 8  # rate: requests in flight
TIMEOUT = 60.0  # any one wait for a transfer, a reply or a landed write
MOONCAKE_BATCH, MOONCAKE_IN_FLIGHT = 16384, 3  # descriptors per Mooncake batch, batches posted
NOTIFY_IMM = 0x50494E47  # ferry: the immediate of a ping-pong write (FerryAdapter)
AWAKE_IMM = 0x57414B45  # ferry: an immediate its sides expect and never get (FerryAdapter)
DATA_IMM, COUNT_IMM, ACK_IMM = 0x44415441, 0x434E5421, 0x41434B21  # ferry: FerryAdapter.wait


# --- the adapters: one per library, the same calls ---------------------------------------------

class Adapter:
    """register(buf) -> what the peer needs; connect(peer's); prepare(src_offsets, dst_offsets,
    lengths) -> a prepared transfer (reusable, one at a time); post(prepared) -> token;
    wait(token). Offsets are bytes into the two registered buffers (numpy uint64 arrays)."""

    def register(self, buf: Any, block_bytes: int = 0) -> Any:
        raise NotImplementedError

    def connect(self, peer_meta: Any) -> None:
        raise NotImplementedError

    def prepare(self, src: Any, dst: Any, lengths: Any) -> Any:
        raise NotImplementedError

    def prepare_blocks(self, src_blocks: Any, dst_blocks: Any, block_bytes: int) -> Any:
        """prepare() for whole blocks: block i of a buffer is bytes [i, i + 1) * block_bytes.
        The KV shape's call; a library with an API for block lists uses it here."""
        import numpy as np

        bb = np.uint64(block_bytes)
        return self.prepare(src_blocks * bb, dst_blocks * bb, bb)

    def prepare_notified(self, src: Any, dst: Any, lengths: Any) -> Any:
        """prepare() for writes whose arrival the target learns through the library's own
        notification (await_arrival); without one, the target polls the bytes themselves."""
        return self.prepare(src, dst, lengths)

    def await_arrival(self, timeout: float = TIMEOUT) -> None:
        """Returns once a write of prepare_notified() arrived, where the library notifies its
        target; the default returns at once and the caller polls memory."""

    def post(self, prepared: Any) -> Any:
        raise NotImplementedError

    def wait(self, token: Any, timeout: float = TIMEOUT) -> None:
        raise NotImplementedError

    def release(self, prepared: Any) -> None:
        """Frees what prepare() made (a library-side handle), where there is any."""

    def unregister(self) -> None:
        raise NotImplementedError

    def post_and_wait(self, prepared: Any, timeout: float = TIMEOUT) -> None:
        self.wait(self.post(prepared), timeout)

    def close(self) -> None:
        pass


def _spin_until(done: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not complete within {timeout:g} s")


class FerryAdapter(Adapter):
    """ferry.TransferEngine: write (one descriptor), write_runs (a list) or paged_write (block
    lists), every write carrying DATA_IMM; the transfer ends at the target's answer.

    A ferry write completes at the initiator when the provider took it (tcp: a write of <= 64 B
    at injection), not when it landed: a ferry user learns of arrival at the target, by
    counting the writes' immediates (Op.imm_writes says how many to expect), as ferry.kv does.
    So that ferry's clock stops where Mooncake's does, at the target's confirmation, wait()
    tells the target how many writes to count (the running total, an 8-byte write with
    COUNT_IMM into its mailbox, posted right behind the transfer) and waits for its
    answer, a signal with ACK_IMM that the target's engine sends from its worker
    (TransferEngine.answer_counts, no Python thread on the way) once DATA_IMM arrived as often
    as the highest total it has read. Totals, not per-transfer counts, so that count writes
    landing out of order (several transfers in flight) cannot make it answer early."""

    BOX = 64  # count slots (8 bytes each) a side writes its counts from, one per write in flight

    def __init__(self, transport: str) -> None:
        import ferry

        self._ferry = ferry
        cma = transport.startswith("shm-cma")
        rma_iovs = 1 if transport.endswith("-iov1") else 4
        rails = 4 if transport.endswith("-rails4") else 1
        transport = transport.removesuffix("-iov1").removesuffix("-rails4")
        # cuda: GPU regions of two processes of this host are written through CUDA IPC
        # whatever the provider; shm carries the immediates and the answer.
        provider = "shm" if cma or transport == "cuda" else transport
        self.engine = ferry.TransferEngine(provider, same_host=True, op_timeout=TIMEOUT,
                                           cma_writes=cma, rma_iovs=rma_iovs, rails=rails)
        # shm-cma-wait: once the first transfer copied by CMA showed its bytes copied by
        # process_vm_writev (stats' cma_bytes grew in the call, so they were in the target's
        # memory when it returned), later such transfers end at Op.wait, without the target's
        # answer. Copied by CMA: write_runs, and single writes above inject_size (smaller ones
        # stay shm's, whose completion says nothing of arrival: they keep the answer).
        self.landed_at_wait: Optional[bool] = None if transport == "shm-cma-wait" else False
        # cuda: GPU to GPU through CUDA IPC, a write's Op completes once its copy finished on
        # the GPU, the bytes then in the target's memory: the clock stops at Op.wait, as NIXL's
        # stops at DONE of its cuda_ipc copies; the writes carry no immediate.
        self.gpu = transport == "cuda"
        self.region = self.expecting = None
        self.answering = False
        self.sent = 0  # DATA_IMM writes posted, counted by the transfers' imm_writes
        self.posted_counts = 0
        self.counts: List[Any] = []  # count writes not yet known complete

    def register(self, buf: Any, block_bytes: int = 0) -> Any:
        import numpy as np

        self.region = self.engine.register(buf)
        if getattr(self, "box", None) is None:  # the mailbox lives as long as the engine
            # slots [0, BOX): the peer's totals (answer_counts reads them); [BOX, 2 BOX): this
            # side's, as it sends them
            self.box = np.zeros(2 * self.BOX, dtype=np.uint64)
            self.box_region = self.engine.register(self.box)
        return (self.engine.address, self.region.descriptor, self.box_region.descriptor)

    def connect(self, peer_meta: Any) -> None:
        address, descriptor, box = peer_meta
        self.peer = self.engine.connect(address)
        self.dst = self._ferry.RemoteRegion.from_bytes(descriptor)
        self.box_dst = self._ferry.RemoteRegion.from_bytes(box)
        # A side written into says it expects writes, as a decode engine waiting for KV does
        # (ferry.kv expects its transfer's immediates): its worker then keeps polling. Idle and
        # expecting nothing, a worker naps up to 1 ms, and a one-sided write over shm or tcp
        # progresses only when the target's worker polls (NIXL's UCX puts over cma need no
        # target at all; over tcp, its progress thread polls).
        if self.expecting is None:
            self.expecting = self.engine.expect_imm(AWAKE_IMM, 1 << 30, 24 * 3600.0)
        if not self.answering:  # once: it answers until the engine closes
            self.engine.answer_counts(COUNT_IMM, DATA_IMM, ACK_IMM, self.peer, self.box_region,
                                      self.BOX)
            self.answering = True

    def prepare(self, src: Any, dst: Any, lengths: Any) -> Any:
        import numpy as np

        if len(src) == 1:
            return (int(src[0]), int(dst[0]), int(lengths[0]))
        return np.stack([src, dst, np.broadcast_to(lengths, src.shape)], axis=1)

    def prepare_blocks(self, src_blocks: Any, dst_blocks: Any, block_bytes: int) -> Any:
        return ("pages", src_blocks, dst_blocks, block_bytes)

    def prepare_notified(self, src: Any, dst: Any, lengths: Any) -> Any:
        return ("imm", int(src[0]), int(dst[0]), int(lengths[0]))

    def await_arrival(self, timeout: float = TIMEOUT) -> None:
        # The target's wait for a write with an immediate: spins, then sleeps until the worker
        # counts it; a Python loop polling the bytes would keep a core from the worker that
        # must poll for a shm or tcp write to land (4 spinning threads on 2 cores).
        self.engine.wait_imm(NOTIFY_IMM, 1, timeout)

    def post(self, prepared: Any) -> Any:
        if isinstance(prepared, tuple) and prepared[0] == "imm":
            _, s, d, n = prepared  # a ping-pong write: the target itself waits for it
            return (self.engine.write(self.peer, self.region, s, self.dst, d, n, NOTIFY_IMM),
                    False)
        if self.gpu:
            return (self._post_data(prepared, None), False)
        # paged_write is never copied by CMA; a single write only above inject_size
        copied = not (isinstance(prepared, tuple) and (
            prepared[0] == "pages" or prepared[2] <= self.engine.inject_size))
        if self.landed_at_wait is None and copied:
            before = self.engine.stats()["cma_bytes"]
            op = self._post_data(prepared)
            self.landed_at_wait = self.engine.stats()["cma_bytes"] > before
        else:
            op = self._post_data(prepared)
        self.sent += op.imm_writes  # counted by the target all the same
        if self.landed_at_wait and copied:
            return (op, False)
        # The count goes right behind the data (imm_writes is known once posted): the target
        # answers when the last write lands, one trip after the data, not after two.
        slot = self.posted_counts % self.BOX  # reused BOX count writes later, by a larger total
        self.posted_counts += 1
        self.box[self.BOX + slot] = self.sent
        self.counts.append(self.engine.write(self.peer, self.box_region, (self.BOX + slot) * 8,
                                             self.box_dst, slot * 8, 8, COUNT_IMM))
        if len(self.counts) > self.BOX // 2:  # long done (answered): keep the list short
            for c in self.counts[:self.BOX // 4]:
                c.wait(TIMEOUT)
            del self.counts[:self.BOX // 4]
        return (op, True)

    def _post_data(self, prepared: Any, imm: Optional[int] = DATA_IMM) -> Any:
        if isinstance(prepared, tuple) and prepared[0] == "pages":
            _, s, d, bb = prepared  # one paged write: page i at i * bb on both sides
            op = self.engine.paged_write(self.peer, self.region, s, bb, self.dst, d, bb, bb, imm)
        elif isinstance(prepared, tuple):
            s, d, n = prepared
            op = self.engine.write(self.peer, self.region, s, self.dst, d, n, imm)
        else:
            op = self.engine.write_runs(self.peer, self.region, self.dst, prepared, imm)
        return op

    def wait(self, token: Any, timeout: float = TIMEOUT) -> None:
        op, acked = token
        if acked:  # the answer first: by then the writes completed here too (one wake-up)
            self.engine.wait_imm(ACK_IMM, 1, timeout)
        op.wait(timeout)

    def unregister(self) -> None:
        if self.region is not None:
            self.region.close()
            self.region = None

    def close(self) -> None:
        self.engine.close()


def _address(buf: Any) -> Tuple[int, int]:
    """(address, bytes) of a numpy array or a torch tensor (CUDA_CONFIGS)."""
    if hasattr(buf, "data_ptr"):
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())
    return int(buf.ctypes.data), int(buf.nbytes)


class NixlAdapter(Adapter):
    """NIXL's nixl_agent: register_memory, agent metadata through add_remote_agent; a list of
    descriptors becomes a handle with initialize_xfer, or, where the buffers were registered
    with a block size (the KV shape), with make_prepped_xfer over descriptor lists of every
    block prepared once at connect time (prep_xfer_dlist), as vLLM's NIXL connector does;
    transfer() posts, check_xfer_state() is polled until DONE."""

    def __init__(self, transport: str, name: str) -> None:
        # UCX reads its transports when NIXL creates the backend's context: set them first.
        # NIXL asks UCX for peer-failure handling, which no shared-memory transport offers
        # ("no active messages transport ... sysv/memory - no peer failure handler"), so "sm"
        # keeps tcp for UCX's active messages; its puts go over cma, zero-copy at every size
        # (UCX_PROTO_INFO=y).
        if transport in ("sm", "tcp"):
            tls = "sm,tcp,self" if transport == "sm" else "tcp,self"
            # On a host with NVIDIA GPUs NIXL refuses a UCX_TLS without a CUDA transport
            # ("Invalid UCX_TLS=sm,tcp,self ... Add cuda_copy"); cuda_copy moves only CUDA
            # memory, so host buffers still go over sm or tcp.
            if os.path.exists("/dev/nvidiactl"):
                tls += ",cuda_copy"
            os.environ["UCX_TLS"] = tls
        elif transport == "cuda":  # GPU to GPU through cuda_ipc; tcp for the active messages
            os.environ["UCX_TLS"] = "cuda_ipc,cuda_copy,tcp,self"
        self.mem, self.dev = ("VRAM", 0) if transport == "cuda" else ("DRAM", 0)
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        from nixl._api import nixl_agent, nixl_agent_config

        backend = "LIBFABRIC" if transport == "libfabric" else "UCX"
        try:
            self.agent = nixl_agent(name, nixl_agent_config(backends=[backend]))
        except Exception as e:  # the plugin did not load: nixlNotFoundError, no message
            raise RuntimeError(f"NIXL could not create its {backend} backend ({e}); run with "
                               "NIXL_LOG_LEVEL=DEBUG for the plugin's load error") from None
        if backend not in self.agent.backends:
            raise RuntimeError(f"NIXL has no {backend} backend here (plugins found: "
                               f"{', '.join(self.agent.get_plugin_list())}; run with "
                               "NIXL_LOG_LEVEL=DEBUG for the plugin's load error)")
        self.backend, self.name = backend, name
        self.reg = self.local_blocks = self.remote_blocks = None

    def register(self, buf: Any, block_bytes: int = 0) -> Any:
        self.buf, self.block_bytes = buf, block_bytes
        self.base, nbytes = _address(buf)
        self.reg = self.agent.register_memory([(self.base, nbytes, self.dev, "")], self.mem)
        if block_bytes:
            self.local_blocks = self.agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", self._blocks(self.base, nbytes), self.mem)
        return (self.agent.get_agent_metadata(), self.base, nbytes)

    def _blocks(self, base: int, nbytes: int) -> Any:
        import numpy as np

        n = nbytes // self.block_bytes
        d = np.zeros((n, 3), dtype=np.uint64)
        d[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(self.block_bytes)
        d[:, 1] = self.block_bytes
        d[:, 2] = self.dev
        return d

    def connect(self, peer_meta: Any) -> None:
        meta, self.peer_base, peer_bytes = peer_meta
        self.peer = self.agent.add_remote_agent(meta)
        if isinstance(self.peer, bytes):
            self.peer = self.peer.decode()
        if self.block_bytes:
            self.remote_blocks = self.agent.prep_xfer_dlist(
                self.peer, self._blocks(self.peer_base, peer_bytes), self.mem)

    def prepare_blocks(self, src_blocks: Any, dst_blocks: Any, block_bytes: int) -> Any:
        import numpy as np

        if block_bytes != self.block_bytes:
            return super().prepare_blocks(src_blocks, dst_blocks, block_bytes)
        return self.agent.make_prepped_xfer("WRITE", self.local_blocks,
                                            src_blocks.astype(np.int32), self.remote_blocks,
                                            dst_blocks.astype(np.int32))

    def prepare(self, src: Any, dst: Any, lengths: Any) -> Any:
        import numpy as np

        n = len(src)
        ld = np.empty((n, 3), dtype=np.uint64)
        rd = np.empty((n, 3), dtype=np.uint64)
        ld[:, 0], rd[:, 0] = src + np.uint64(self.base), dst + np.uint64(self.peer_base)
        ld[:, 1] = rd[:, 1] = lengths
        ld[:, 2] = rd[:, 2] = self.dev
        return self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(ld, self.mem),
                                          self.agent.get_xfer_descs(rd, self.mem), self.peer)

    def post(self, prepared: Any) -> Any:
        if self.agent.transfer(prepared) == "ERR":
            raise RuntimeError("NIXL transfer() returned ERR")
        return prepared

    def wait(self, token: Any, timeout: float = TIMEOUT) -> None:
        def done() -> bool:
            state = self.agent.check_xfer_state(token)
            if state == "ERR":
                raise RuntimeError("NIXL check_xfer_state() returned ERR")
            return state == "DONE"
        _spin_until(done, timeout, "a NIXL transfer")

    def release(self, prepared: Any) -> None:
        self.agent.release_xfer_handle(prepared)

    def unregister(self) -> None:
        for h in (self.local_blocks, self.remote_blocks):
            if h is not None:
                self.agent.release_dlist_handle(h)
        self.local_blocks = self.remote_blocks = None
        if self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None
        if getattr(self, "peer", None):
            self.agent.remove_remote_agent(self.peer)
            self.peer = None


class MooncakeAdapter(Adapter):
    """Mooncake's TransferEngine (P2P handshake, no metadata server): register_memory, the
    peer's "host:rpc port" and buffer address; a list of descriptors is three Python lists of
    addresses and lengths, posted by batch_transfer_async_write and waited for by
    get_batch_transfer_status."""

    def __init__(self, transport: str) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # else an INFO line per batch
        # A batch of 16,384 descriptors fails (get_batch_transfer_status -1, "TCP lane
        # queue-full rejection") with the default per-peer queue of 1024; 65535 is the most it
        # takes ("Invalid MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER value: 65536, using default"),
        # and the KV shape's 131,072 descriptors go as batches of MOONCAKE_BATCH, at most
        # MOONCAKE_IN_FLIGHT of them posted (post() waits for the oldest beyond that).
        os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "65535")
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        rc = self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", transport, "")
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize(..., {transport!r}) = {rc}")
        self.session = f"127.0.0.1:{self.engine.get_rpc_port()}"
        self.base = None

    def register(self, buf: Any, block_bytes: int = 0) -> Any:
        self.base = buf.ctypes.data
        rc = self.engine.register_memory(self.base, buf.nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory = {rc}")
        return (self.session, self.base)

    def connect(self, peer_meta: Any) -> None:
        self.peer, self.peer_base = peer_meta

    def prepare(self, src: Any, dst: Any, lengths: Any) -> Any:
        import numpy as np

        s = (src + np.uint64(self.base)).tolist()
        d = (dst + np.uint64(self.peer_base)).tolist()
        n = np.broadcast_to(lengths, src.shape).tolist()
        return [(s[i:i + MOONCAKE_BATCH], d[i:i + MOONCAKE_BATCH], n[i:i + MOONCAKE_BATCH])
                for i in range(0, len(s), MOONCAKE_BATCH)]

    def post(self, prepared: Any) -> Any:
        batches = []
        for i, part in enumerate(prepared):
            if i >= MOONCAKE_IN_FLIGHT:  # the per-peer queue holds at most 65535
                self.wait([batches[i - MOONCAKE_IN_FLIGHT]])
            batch = self.engine.batch_transfer_async_write(self.peer, *part)
            if batch == 0:
                raise RuntimeError("Mooncake batch_transfer_async_write failed (batch id 0)")
            batches.append(batch)
        return batches[-MOONCAKE_IN_FLIGHT:]

    def wait(self, token: Any, timeout: float = TIMEOUT) -> None:
        rc = self.engine.get_batch_transfer_status(token)  # blocks until all are done
        if rc != 0:
            raise RuntimeError(f"Mooncake get_batch_transfer_status = {rc}")

    def unregister(self) -> None:
        if self.base is not None:
            self.engine.unregister_memory(self.base)
            self.base = None


class UcclAdapter(Adapter):
    """UCCL's P2P engine; needs Python >= 3.12 and a CUDA driver (uccl 0.1.1)."""

    def __init__(self, transport: str) -> None:
        from uccl import p2p  # noqa: F401  (ImportError names the missing CUDA library)

        raise RuntimeError("uccl.p2p imported, but ferry.bench_peers has no UCCL adapter yet "
                           "(GPU machine only, docs/BENCHMARKS.md)")


def make_adapter(config: str, name: str) -> Adapter:
    lib, transport = CONFIGS[config]
    if lib == "ferry":
        return FerryAdapter(transport)
    if lib == "nixl":
        return NixlAdapter(transport, name)
    if lib == "mooncake":
        return MooncakeAdapter(transport)
    return UcclAdapter(transport)


# --- the worker: one side of a pair -----------------------------------------------------------

class Side:
    """What a worker process does on the coordinator's commands."""

    def __init__(self, config: str, role: str) -> None:
        self.cuda = config in CUDA_CONFIGS
        if self.cuda:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device here (torch.cuda.is_available() is False)")
        self.adapter = make_adapter(config, f"{config}-{role}-{os.getpid()}")
        self.buf = None

    def buffer(self, nbytes: int, fill: int, block_bytes: int = 0) -> Any:
        import numpy as np

        if self.buf is not None:
            self.adapter.unregister()
        self.buf = None
        buf = np.empty(nbytes, dtype=np.uint8)
        buf[:] = fill
        if fill == 0:  # a source: bytes that differ from offset to offset
            buf[:min(nbytes, 1 << 16)] = np.arange(min(nbytes, 1 << 16), dtype=np.uint8) * 7 + 3
            done = 1 << 16
            while done < nbytes:
                n = min(done, nbytes - done)
                buf[done:done + n] = buf[:n] + 1
                done += n
        if self.cuda:  # the same bytes on the GPU
            import torch

            buf = torch.from_numpy(buf).to("cuda:0")
            torch.cuda.synchronize()
        self.buf = buf
        return self.adapter.register(buf, block_bytes)

    def connect(self, peer_meta: Any) -> None:
        self.adapter.connect(peer_meta)

    def read(self, offset: int, nbytes: int) -> bytes:
        if self.cuda:
            return self.buf[offset:offset + nbytes].cpu().numpy().tobytes()
        return bytes(self.buf[offset:offset + nbytes])

    def write_runs(self, src: Any, dst: Any, lengths: Any, block_bytes: int = 0,
                   timeout: float = TIMEOUT) -> None:
        """Writes the runs once (the tests' check that bytes arrive intact); with block_bytes,
        src and dst are block numbers, through prepare_blocks."""
        p = (self.adapter.prepare_blocks(src, dst, block_bytes) if block_bytes else
             self.adapter.prepare(src, dst, lengths))
        try:
            self.adapter.post_and_wait(p, timeout)
        finally:
            self.adapter.release(p)

    def bw(self, size: int, reps: int) -> float:
        import numpy as np

        z = np.zeros(1, dtype=np.uint64)
        p = self.adapter.prepare(z, z, np.array([size], dtype=np.uint64))
        try:
            self.adapter.post_and_wait(p)  # warm-up: connection, first-touch, caches
            t0 = time.perf_counter()
            for _ in range(reps):
                self.adapter.post_and_wait(p)
            return size * reps / (time.perf_counter() - t0) / 1e9
        finally:
            self.adapter.release(p)

    def arm(self, size: int) -> None:
        """Clears the flag byte pingpong(size) waits on; both sides before either starts."""
        self.buf[2 * size - 1] = 0

    def pingpong(self, size: int, iters: int, initiator: bool) -> List[float]:
        """Half round trips in microseconds (initiator) or nothing (responder). The flag is the
        last byte of the write (1..255, never 0: arm() cleared it); each side writes from its
        slot 0 into the other's slot 1, and learns of the other's write by the library's
        notification where it has one for single writes (ferry: an immediate), else by polling
        the flag (NIXL's notifications are messages sent after the data; Mooncake's tcp
        transport has none)."""
        import numpy as np

        one = np.array([size], dtype=np.uint64)
        p = self.adapter.prepare_notified(np.zeros(1, dtype=np.uint64), one, one)
        flag_out, flag_in = size - 1, 2 * size - 1
        buf, out = self.buf, []
        clock = time.perf_counter
        try:
            for i in range(iters):
                seq = i % 255 + 1
                if initiator:
                    buf[flag_out] = seq
                    t0 = clock()
                    tok = self.adapter.post(p)
                    self.adapter.await_arrival()
                    self._landed(flag_in, seq)
                    out.append((clock() - t0) * 1e6 / 2)
                    self.adapter.wait(tok)
                else:
                    self.adapter.await_arrival()
                    self._landed(flag_in, seq)
                    buf[flag_out] = seq
                    self.adapter.wait(self.adapter.post(p))
        finally:
            self.adapter.release(p)
        return out

    def _landed(self, index: int, seq: int) -> None:
        buf, n = self.buf, 0
        while buf[index] != seq:
            n += 1
            if n & 0xFFF == 0:
                _spin_until(lambda: buf[index] == seq, TIMEOUT, "a ping-pong write")

    def rate(self, size: int, batch: int, seconds: float) -> float:
        import numpy as np

        preps = []
        for w in range(WINDOW):
            offs = (np.arange(batch, dtype=np.uint64) + np.uint64(w * batch)) * np.uint64(size)
            preps.append(self.adapter.prepare(offs, offs, np.full(batch, size, dtype=np.uint64)))
        try:
            for p in preps:  # warm-up
                self.adapter.post_and_wait(p)
            toks = [self.adapter.post(p) for p in preps]
            n, t0 = 0, time.perf_counter()
            end = t0 + seconds
            while True:
                i = n % WINDOW
                self.adapter.wait(toks[i])
                n += 1
                if time.perf_counter() >= end:
                    break
                toks[i] = self.adapter.post(preps[i])
            for k in range(1, WINDOW):
                self.adapter.wait(toks[(n - 1 + k) % WINDOW])
            n += WINDOW - 1
            return n * batch / (time.perf_counter() - t0)
        finally:
            for p in preps:
                self.adapter.release(p)

    def kv(self, layers: int, blocks: int, pool: int, block_bytes: int, seed: int) -> Tuple:
        """One KV transfer: `blocks` random blocks of a pool of `pool` per (layer, K/V), into
        random blocks of the peer's pool of the same shape. Seconds from the block ids to a
        prepared transfer (descriptor lists, handles), to the post call's return, and from the
        post call to the library's completion."""
        import numpy as np

        rng = np.random.default_rng(seed)
        src_ids = rng.choice(pool, blocks, replace=False).astype(np.uint64)
        dst_ids = rng.choice(pool, blocks, replace=False).astype(np.uint64)
        t0 = time.perf_counter()
        # Block b of layer l, K (0) or V (1) is block (2 * l + kv) * pool + b of the buffer.
        planes = (np.arange(2 * layers, dtype=np.uint64) * np.uint64(pool))[:, None]
        src = (planes + src_ids[None, :]).ravel()
        dst = (planes + dst_ids[None, :]).ravel()
        p = self.adapter.prepare_blocks(src, dst, block_bytes)
        t1 = time.perf_counter()
        tok = self.adapter.post(p)
        t2 = time.perf_counter()
        self.adapter.wait(tok)
        t3 = time.perf_counter()
        self.adapter.release(p)
        return (t1 - t0, t2 - t0, t3 - t1)

    def close(self) -> None:
        if self.buf is not None:
            self.adapter.unregister()
        self.adapter.close()


def _die_with_parent() -> None:
    """SIGKILL when the coordinator dies: a pair it stopped (SIGSTOP) cannot notice by itself."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker(conn: Any, config: str, role: str) -> None:
    """A pair's side: answers (command, args...) with ("ok", value) or ("err", message) until
    ("exit",), a closed pipe, or 600 s without a command (a vanished coordinator)."""
    _die_with_parent()
    try:
        side = Side(config, role)
    except BaseException as e:  # the peer cannot run here: the coordinator reports why
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", None))
    while conn.poll(600):
        try:
            cmd, *args = conn.recv()
        except EOFError:
            break
        if cmd == "exit":
            side.close()
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", getattr(side, cmd)(*args)))
        except Exception as e:
            conn.send(("err", f"{type(e).__name__}: {e}"))


class PairError(RuntimeError):
    pass


class Pair:
    """Two worker processes of one configuration: "a" initiates, "b" is written into."""

    def __init__(self, config: str) -> None:
        self.config, self.current = config, None
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for role in ("a", "b"):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(theirs, config, role), daemon=True)
            p.start()
            self.conns.append(mine)
            self.procs.append(p)
        try:
            for c in self.conns:
                self._reply(c, TIMEOUT)
        except PairError:
            self.close()
            raise
        self.running = True

    def _reply(self, conn: Any, timeout: float) -> Any:
        try:
            if not conn.poll(timeout):
                raise PairError(f"{self.config}: no reply within {timeout:g} s")
            status, value = conn.recv()
        except (EOFError, OSError):
            codes = [p.exitcode for p in self.procs]
            raise PairError(f"{self.config}: a worker process ended (exit codes {codes})") from None
        if status != "ok":
            raise PairError(f"{self.config}: {value}")
        return value

    def _send(self, side: int, cmd: Tuple) -> None:
        try:
            self.conns[side].send(cmd)
        except OSError:
            codes = [p.exitcode for p in self.procs]
            raise PairError(f"{self.config}: a worker process ended (exit codes {codes})") from None

    def call(self, side: int, *cmd: Any, timeout: float = 600.0) -> Any:
        self._send(side, cmd)
        return self._reply(self.conns[side], timeout)

    def both(self, cmd_a: Tuple, cmd_b: Tuple, timeout: float = 600.0) -> Tuple[Any, Any]:
        self._send(0, cmd_a)
        self._send(1, cmd_b)
        return self._reply(self.conns[0], timeout), self._reply(self.conns[1], timeout)

    def setup(self, nbytes: int, block_bytes: int = 0) -> None:
        """A fresh source buffer on a (a pattern) and a destination on b (poisoned, 0xA5),
        registered, and each side connected to the other."""
        if self.current == (nbytes, block_bytes):
            return
        self.current = None
        meta_a, meta_b = self.both(("buffer", nbytes, 0, block_bytes),
                                   ("buffer", nbytes, 0xA5, block_bytes))
        self.both(("connect", meta_b), ("connect", meta_a))
        self.current = (nbytes, block_bytes)

    def pause(self, stop: bool) -> None:
        if stop != self.running:
            return
        for p in self.procs:
            try:
                os.kill(p.pid, signal.SIGSTOP if stop else signal.SIGCONT)
            except ProcessLookupError:  # it ended: its next reply says so (_reply)
                pass
        self.running = not stop

    def close(self) -> None:
        if getattr(self, "running", True) is False:
            self.pause(False)
        for c, p in zip(self.conns, self.procs):
            try:
                c.send(("exit",))
                c.poll(10) and c.recv()
            except (OSError, EOFError):
                pass
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


# --- the coordinator --------------------------------------------------------------------------

def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB" if n >= KiB else f"{n} B"


class Point:
    """One measured point: name, how to set a pair up for it, how to measure it once."""

    def __init__(self, pattern: str, label: str, setup: Tuple, measure: Callable[..., dict],
                 higher: Dict[str, bool]) -> None:
        self.pattern, self.label, self.setup, self.measure = pattern, label, setup, measure
        self.higher = higher  # figure -> whether higher is better


def points(opts: argparse.Namespace) -> List[Point]:
    pts = []
    if "bw" in opts.patterns:
        biggest = max(opts.sizes)
        for size in opts.sizes:
            reps = max(3, min(200, (opts.bw_bytes // size)))
            pts.append(Point("bw", f"write {_size(size)}", (biggest,),
                             lambda pair, r, s=size, n=reps: {"GB/s": pair.call(0, "bw", s, n)},
                             {"GB/s": True}))
    if "lat" in opts.patterns:
        for size in (64, 4 * KiB):
            def lat(pair: Pair, r: int, s: int = size) -> dict:
                pair.both(("arm", s), ("arm", s))
                us, _ = pair.both(("pingpong", s, opts.iters, True),
                                  ("pingpong", s, opts.iters, False))
                us = us[min(len(us) // 10, 100):]
                return {"p50 us": percentile(us, 0.5), "p99 us": percentile(us, 0.99)}
            pts.append(Point("lat", f"latency {_size(size)}", (4 * size,), lat,
                             {"p50 us": False, "p99 us": False}))
    if "rate" in opts.patterns:
        for size in (64, 4 * KiB):
            for batch in (1, 64):
                pts.append(Point("rate", f"rate {_size(size)} x{batch}",
                                 (WINDOW * 64 * 4 * KiB,),
                                 lambda pair, r, s=size, b=batch: {
                                     "desc/s": pair.call(0, "rate", s, b, opts.seconds)},
                                 {"desc/s": True}))
    if "kv" in opts.patterns:
        layers, tokens = 64, opts.kv_tokens
        for bt in opts.kv_blocks:
            bb = bt * 128 * 2  # one KV head of 128, bf16
            blocks = max(1, tokens // bt)
            pool = blocks + max(1, blocks // 4)

            def kv(pair: Pair, r: int, bb: int = bb, blocks: int = blocks,
                   pool: int = pool) -> dict:
                prep, posted, xfer = pair.call(0, "kv", layers, blocks, pool, bb, 1000 + r)
                return {"transfer ms": xfer * 1e3, "prep ms": prep * 1e3,
                        "posted ms": posted * 1e3}
            pts.append(Point("kv", f"KV {tokens // 1024}k tok, {bt}-tok blocks "
                             f"({2 * layers * blocks} x {_size(bb)})",
                             (2 * layers * pool * bb, bb), kv,
                             {"transfer ms": False, "prep ms": False, "posted ms": False}))
    return pts


def peer_status(name: str) -> Optional[str]:
    """None if the peer's module is importable here, else a line saying how to get it."""
    module, how = PEERS[name]
    if name == "uccl" and sys.version_info < (3, 12):
        return (f"uccl: needs Python >= 3.12 (this is {sys.version_info[0]}.{sys.version_info[1]})"
                " and a CUDA driver: uccl 0.1.1's p2p module links libcudart.so.12 and "
                "libcuda.so.1")
    try:
        found = importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return f"{name}: not installed ({how}; or {INSTALL})"
    return None


def _ratio(ferry: float, peer: float, higher: bool) -> float:
    if ferry <= 0 or peer <= 0:
        return float("nan")
    return ferry / peer if higher else peer / ferry


def run(opts: argparse.Namespace, log: Callable[[str], None]) -> dict:
    configs, skipped = [], {}
    for transport in opts.transports:
        ferry_cfg, peers = PAIRINGS[transport]
        configs.append(ferry_cfg)
        for cfg in peers:
            lib = CONFIGS[cfg][0]
            if lib not in opts.peers or cfg in configs or cfg in skipped:
                continue
            why = peer_status(lib)
            if why:
                skipped[cfg] = why
            else:
                configs.append(cfg)
    pairs: Dict[str, Pair] = {}
    for cfg in configs:
        try:
            pairs[cfg] = Pair(cfg)
            pairs[cfg].pause(True)
        except PairError as e:
            skipped[cfg] = f"cannot run here: {e}"
    for cfg, why in skipped.items():
        log(f"skipped {cfg}: {why}")
    live = [c for c in configs if c in pairs]
    pts = points(opts)
    results: Dict[str, Dict[str, Dict[str, List[float]]]] = {}
    try:
        for k, pt in enumerate(pts):
            per = results.setdefault(pt.label, {})
            for cfg in live:  # each pair gets this point's buffers, then waits stopped
                pair = pairs[cfg]
                pair.pause(False)
                try:
                    pair.setup(*pt.setup)
                except PairError as e:
                    log(f"{cfg}: {pt.label}: setup failed: {e}")
                pair.pause(True)
            t0 = last_log = time.monotonic()
            for r in range(opts.rounds):
                if time.monotonic() - last_log > 20:  # a long point says where it is
                    log(f"  {pt.label}: round {r + 1} of {opts.rounds}, "
                        f"{time.monotonic() - t0:.0f} s so far")
                    last_log = time.monotonic()
                order = live if r % 2 == 0 else live[::-1]
                for cfg in order:
                    pair = pairs[cfg]
                    pair.pause(False)
                    try:
                        figs = pt.measure(pair, r)
                    except PairError as e:
                        log(f"{cfg}: {pt.label}: {e}")
                        figs = {f: float("nan") for f in pt.higher}
                    pair.pause(True)
                    for f, v in figs.items():
                        per.setdefault(cfg, {}).setdefault(f, []).append(v)
            log(f"[{k + 1}/{len(pts)}] {pt.label}: {opts.rounds} rounds in "
                f"{time.monotonic() - t0:.1f} s: " + ", ".join(
                    f"{cfg} {_median(per[cfg][next(iter(pt.higher))]):.4g}" for cfg in live
                    if cfg in per))
    finally:
        for pair in pairs.values():
            pair.close()
    return _report(opts, pts, results, live, skipped)


def _median(v: Sequence[float]) -> float:
    v = [x for x in v if x == x]
    return percentile(v, 0.5) if v else float("nan")


def _report(opts: argparse.Namespace, pts: List[Point], results: dict, live: List[str],
            skipped: Dict[str, str]) -> dict:
    rows = []
    for pt in pts:
        per = results.get(pt.label, {})
        for transport in opts.transports:
            ferry_cfg, peers = PAIRINGS[transport]
            for cfg in peers:
                if cfg not in live or ferry_cfg not in per or cfg not in per:
                    continue
                for fig, higher in pt.higher.items():
                    fv, pv = per[ferry_cfg][fig], per[cfg][fig]
                    ratios = sorted(x for x in (_ratio(a, b, higher) for a, b in zip(fv, pv))
                                    if x == x)
                    rows.append({
                        "pattern": pt.pattern, "point": pt.label, "figure": fig,
                        "higher_is_better": higher, "transport": transport,
                        "ferry": ferry_cfg, "peer": cfg, "ferry_median": _median(fv),
                        "peer_median": _median(pv), "ferry_runs": fv, "peer_runs": pv,
                        "ratio_median": percentile(ratios, 0.5) if ratios else float("nan"),
                        "ratio_q1": percentile(ratios, 0.25) if ratios else float("nan"),
                        "ratio_q3": percentile(ratios, 0.75) if ratios else float("nan")})
    return {"rounds": opts.rounds, "quick": opts.quick, "configs": live, "skipped": skipped,
            "versions": _versions(), "rows": rows, "cpus": os.cpu_count()}


def _versions() -> Dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("ferry", "nixl", "nixl-cu12", "nixl-cu13",
                 "mooncake-transfer-engine-non-cuda", "uccl"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def print_table(res: dict) -> None:
    print(f"ferry beside its peers: {res['rounds']} rounds, ratio > 1 = ferry better "
          "(median [q1, q3] of per-round ratios)")
    print(f"{'point':<34} {'figure':<12} {'ferry':<10} {'value':>10}  {'peer':<15} "
          f"{'value':>10}  {'ratio':>22}")
    for r in res["rows"]:
        print(f"{r['point']:<34} {r['figure']:<12} {r['ferry']:<10} {r['ferry_median']:>10.4g}  "
              f"{r['peer']:<15} {r['peer_median']:>10.4g}  "
              f"{r['ratio_median']:>6.2f}x [{r['ratio_q1']:.2f}, {r['ratio_q3']:.2f}]")
    for cfg, why in res["skipped"].items():
        print(f"skipped {cfg}: {why}")


def markdown_table(res: dict) -> str:
    """The report as a Markdown table (docs/BENCHMARKS.md), one row per pairing and figure."""
    out = ["| point | figure | ferry | value | peer | value | ferry vs peer: median [q1, q3] |",
           "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        out.append(f"| {r['point']} | {r['figure']} | {r['ferry']} | {r['ferry_median']:.4g} | "
                   f"{r['peer']} | {r['peer_median']:.4g} | {r['ratio_median']:.2f}x "
                   f"[{r['ratio_q1']:.2f}, {r['ratio_q3']:.2f}] |")
    return "\n".join(out)


def _choice_list(known: Sequence[str], what: str) -> Callable[[str], List[str]]:
    def parse(text: str) -> List[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in known]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, bad)) or '(none given)'}; "
                f"choose from {', '.join(known)}")
        return list(dict.fromkeys(items))
    return parse


def _size_list(text: str) -> List[int]:
    units = {"": 1, "k": KiB, "kib": KiB, "m": MiB, "mib": MiB}
    out = []
    for t in text.split(","):
        t = t.strip().lower()
        num = t.rstrip("kmib")
        unit = t[len(num):]
        if not num.isdigit() or unit not in units:
            raise argparse.ArgumentTypeError(f"a size such as 64k or 16m, not {t!r}")
        v = int(num) * units[unit]
        if not 1 <= v <= 1 << 30:
            raise argparse.ArgumentTypeError(f"sizes must be in [1 B, 1 GiB], got {t!r}")
        out.append(v)
    return out


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m ferry.bench_peers",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--peers", type=_choice_list(list(PEERS), "peer"),
                    default=list(PEERS), help="the peers to compare with (default: all)")
    ap.add_argument("--transports", type=_choice_list(list(PAIRINGS), "transport"),
                    default=DEFAULT_TRANSPORTS,
                    help="ferry's transports (default: shm,tcp; shm-cma: shm with cma_writes; "
                    "shm-iov1, tcp-iov1: one fabric operation per run (rma_iovs=1); "
                    "shm-rails4, tcp-rails4: 4 rails, large writes striped and pages rotated "
                    "over them; "
                    "cuda: GPU memory on cuda:0, both processes on it, bw and kv only)")
    ap.add_argument("--patterns", type=_choice_list(["bw", "lat", "rate", "kv"], "pattern"),
                    default=["bw", "lat", "rate", "kv"])
    ap.add_argument("--rounds", type=count(1, 1000), default=None,
                    help="alternating rounds per point (default 5; --quick 1)")
    ap.add_argument("--sizes", type=_size_list, default=None,
                    help="bw sizes (default 64k,1m,16m,256m; --quick 64k,1m)")
    ap.add_argument("--iters", type=count(20, 1000000), default=None,
                    help="lat: ping-pongs per round (default 1000; --quick 200)")
    ap.add_argument("--seconds", type=seconds_flag(600), default=None,
                    help="rate: seconds per round (default 1; --quick 0.2)")
    ap.add_argument("--kv-tokens", type=count(128, 1 << 20), default=None,
                    help="kv: tokens moved (default 16384; --quick 2048)")
    ap.add_argument("--kv-blocks", type=_choice_list(["16", "128"], "block size"),
                    default=["16", "128"], help="kv: tokens per block")
    ap.add_argument("--quick", action="store_true",
                    help="a short pass (CI: under 2 minutes): 1 round, small sizes")
    ap.add_argument("--json", help="write the report as JSON to this file")
    ap.add_argument("--markdown", action="store_true",
                    help="print the table as Markdown (docs/BENCHMARKS.md)")
    ap.add_argument("--from-json", metavar="FILE",
                    help="print the table of an earlier --json report, running nothing")
    ap.add_argument("--list", action="store_true",
                    help="say which peers are installed here and exit")
    opts = ap.parse_args(argv)
    q = opts.quick
    opts.rounds = opts.rounds or (1 if q else 5)
    opts.sizes = opts.sizes or ([64 * KiB, MiB] if q else [64 * KiB, MiB, 16 * MiB, 256 * MiB])
    opts.iters = opts.iters or (200 if q else 1000)
    opts.seconds = opts.seconds or (0.2 if q else 1.0)
    opts.kv_tokens = opts.kv_tokens or (2048 if q else 16384)
    opts.kv_blocks = [int(b) for b in opts.kv_blocks]
    opts.bw_bytes = (64 if q else 1024) * MiB  # bytes moved per bw round
    if "cuda" in opts.transports:
        other = sorted(set(opts.patterns) - set(CUDA_PATTERNS))
        if other and opts.transports != ["cuda"]:
            ap.error(f"--transports cuda runs only the patterns {','.join(CUDA_PATTERNS)} (its "
                     f"buffers are GPU memory); run it alone or with --patterns bw,kv, not "
                     f"{','.join(other)}")
        opts.patterns = [p for p in opts.patterns if p in CUDA_PATTERNS]
    if opts.from_json and not os.path.isfile(opts.from_json):
        ap.error(f"--from-json: no file {opts.from_json!r}")
    if opts.json and not os.path.isdir(os.path.dirname(os.path.abspath(opts.json))):
        ap.error(f"--json: the folder of {opts.json!r} does not exist")
    return opts


def main(argv: Optional[List[str]] = None) -> int:
    opts = parse_args(argv)
    if opts.list:
        for name in PEERS:
            print(peer_status(name) or f"{name}: installed")
        return 0

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # Ctrl-C and SIGTERM end the run through run()'s cleanup, which resumes and ends the stopped
    # pairs (libfabric's psm provider, loaded with ferry, installs SIGINT and SIGTERM handlers
    # of its own that kept the run going).
    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)

    if opts.from_json:
        with open(opts.from_json) as f:
            res = json.load(f)
    else:
        res = run(opts, log)
        write_json(opts.json, res)
    if opts.markdown:
        print(markdown_table(res))
    else:
        print_table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
