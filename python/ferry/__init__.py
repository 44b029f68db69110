"""ferry: one-sided RDMA for LLM inference over libfabric, from Python.

The TransferEngine registers memory (numpy arrays, torch tensors, any writable buffer, or a raw
``(ptr, nbytes, device)`` tuple), connects to peers by their address bytes, and moves bytes with
one-sided writes (optionally carrying a 32-bit immediate the target counts), paged writes,
multi-run writes and reads. Every operation returns an :class:`Op` to poll or wait on; every
error is a :class:`ferry.Error` subclass carrying ferry's message. Blocking calls release the
GIL, and ferry never calls into Python from its own threads. See docs/PYTHON.md.
"""

from __future__ import annotations

import numbers
import operator
import os
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np


def _load_extension() -> Any:
    """Imports ferry._ferry without letting it take the process's fatal-signal handlers.

    libfabric links libinfinipath (its psm provider), whose constructor installs handlers for
    SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL and SIGABRT that print a backtrace and call
    exit(1): Ctrl-C in a program that imported ferry ended it with status 1 instead of raising
    KeyboardInterrupt, and SIGTERM ran exit handlers from a signal handler (it could hang). The
    dispositions from before the import (Python's, faulthandler's) are put back after it.
    The constructor then calibrates its clock for ~0.1-0.2 s. Blocking SIGINT and SIGTERM in
    the importing thread was not enough: a process-directed signal goes to any thread that does
    not block it, and threads started before the import (numpy's OpenBLAS pool from PyPI, the
    program's own) then ran those handlers, whose exit(1) from a side thread hung the process.
    So the handlers are not installed at all: libinfinipath skips them when
    ``IPATH_NO_BACKTRACE`` is set, which ferry sets before loading the extension unless the
    program set it. The signals stay blocked in the importing thread and the old dispositions
    are still put back, for a libinfinipath that ignores the variable.
    """
    os.environ.setdefault("IPATH_NO_BACKTRACE", "1")  # read by libinfinipath's constructor
    import ctypes
    import signal as _signal

    sigs = [_signal.SIGINT, _signal.SIGTERM, _signal.SIGSEGV, _signal.SIGBUS, _signal.SIGILL,
            _signal.SIGABRT]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sigaction = libc.sigaction
    except (OSError, AttributeError):  # not glibc-like: nothing to keep
        from . import _ferry as ext
        return ext
    saved = {}
    for sig in sigs:
        buf = ctypes.create_string_buffer(512)  # >= any struct sigaction; copied back as is
        if sigaction(int(sig), None, buf) == 0:
            saved[sig] = buf
    mask = _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT, _signal.SIGTERM})
    try:
        from . import _ferry as ext
    finally:
        for sig, buf in saved.items():
            sigaction(int(sig), buf, None)
        _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)
    return ext


_ferry = _load_extension()
from ._ferry import (
    AlreadyExists,
    Cancelled,
    Error,
    ImmExpectation,
    InternalError,
    InvalidArgument,
    InvalidType,
    NotFound,
    Op,
    OutOfRange,
    PermissionDenied,
    ProtocolError,
    ProviderError,
    Region,
    RemoteRegion,
    ResourceExhausted,
    TimeoutError,
    Unavailable,
    gpu_device_count,
)
from . import _log

_log.install(_ferry)  # the library's log lines to the "ferry" logger (ferry/_log.py)

__version__ = "0.1.0"

__all__ = [
    "TransferEngine", "Peer", "Region", "RemoteRegion", "Op", "ImmExpectation",
    "Error", "InvalidArgument", "InvalidType", "OutOfRange", "NotFound", "TimeoutError", "Unavailable",
    "Cancelled", "ResourceExhausted", "ProtocolError", "ProviderError", "InternalError",
    "PermissionDenied", "AlreadyExists",
    "gpu_device_count", "__version__",
]



def __dir__() -> list:
    """What the package offers (its __all__ and submodules), not the modules it imports."""
    return sorted(set(__all__) | {"kv", "moe"})


_U32_MAX = 0xFFFFFFFF
_I32_MAX = 0x7FFFFFFF
_U64_MAX = 0xFFFFFFFFFFFFFFFF


class Peer(int):
    """A connected peer: the engine's id for it (an int), from TransferEngine.connect."""

    def __repr__(self) -> str:
        return f"ferry.Peer({int(self)})"


def __getattr__(name: str) -> Any:
    # ferry.moe imports torch: only for the programs that use it; ferry.kv likewise on demand.
    if name in ("moe", "kv"):
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'ferry' has no attribute {name!r}")


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    """An int in [lo, hi] (numpy integers too; bool and float refused), or InvalidArgument."""
    if isinstance(value, bool):
        raise InvalidType(f"{name} must be an integer, got bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidType(f"{name} must be an integer, got {type(value).__name__}") from None
    if v < lo or v > hi:
        raise InvalidArgument(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def _uint(name: str, value: Any, limit: int = _U64_MAX) -> int:
    return _int(name, value, 0, limit)


def _bool(name: str, value: Any) -> bool:
    """True or False (numpy's bool_ and the ints 0 and 1 too): a string such as "false" is
    truthy, so bool(value) would take it for True."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise InvalidType(f"{name} must be True or False, got {value!r}"[:200])


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidType(f"{name} must be a string, got {type(value).__name__}")
    return value


def _imm(imm: Optional[int]) -> Optional[int]:
    return None if imm is None else _uint("imm", imm, _U32_MAX)


# Waits spin before they sleep where this process may run on at least this many CPUs: the two
# sides of a ping-pong then spin on 4 threads (each side's waiter and engine worker) with cores
# to spare. On a 2-core host a spinning waiter takes the core its own worker needs (3.7 ms p50
# latency measured there, against 13 us sleeping; docs/BENCHMARKS.md).
_SPIN_MIN_CPUS = 8
_AUTO_WAIT_SPIN_US = 50.0


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, else os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _wait_spin_us(value: Any) -> Any:
    """What None (auto) means on this host; any other value as given (the extension checks
    it)."""
    if value is None:
        return _AUTO_WAIT_SPIN_US if _usable_cpus() >= _SPIN_MIN_CPUS else 0.0
    return value


def _is_tensor(obj: Any) -> bool:
    # Duck-typed so that no torch import (or link) is needed: torch 1.13 and 2.x alike.
    return all(hasattr(obj, a) for a in ("data_ptr", "is_contiguous", "element_size", "numel",
                                         "device"))


def _tensor_data_ptr(name: str, t: Any) -> int:
    """t.data_ptr(), or InvalidArgument naming `name` for a tensor without one dense range of
    memory (sparse, quantized, ...: torch raises its own RuntimeError)."""
    layout = str(getattr(t, "layout", "torch.strided"))
    if layout != "torch.strided":
        raise InvalidArgument(f"{name}: a tensor of layout {layout} has no dense memory to "
                              "register; pass t.to_dense()")
    try:
        return int(t.data_ptr())
    except RuntimeError as e:
        raise InvalidArgument(f"{name}: cannot take the data pointer of this tensor: {e}") \
            from None


def _device_index(device: Any) -> int:
    """-1 for host memory, the CUDA ordinal for GPU memory."""
    if device is None:
        return -1
    if isinstance(device, bool):
        raise InvalidType("device must be None, -1, 'cpu', 'cuda', 'cuda:N' or a CUDA "
                          "ordinal N >= 0, got bool")
    if isinstance(device, numbers.Integral):
        if device == -1:
            return -1
        return _int("device (a CUDA ordinal, or -1 for host memory)", device, 0, _I32_MAX)
    kind = getattr(device, "type", None)
    index = getattr(device, "index", None)
    if kind is None:  # a string: "cpu", "cuda", "cuda:1"
        if not isinstance(device, str):
            raise InvalidType("device must be None, -1, 'cpu', 'cuda', 'cuda:N' or a CUDA "
                              f"ordinal N >= 0, got {type(device).__name__}")
        kind, colon, idx = device.partition(":")
        index = None
        if colon:
            if not idx.isdigit():
                raise InvalidArgument(f"cannot register memory on device '{device}': a device "
                                      "is 'cpu', 'cuda' or 'cuda:N' with N a CUDA ordinal")
            index = int(idx)
    if kind == "cpu":
        return -1
    if kind == "cuda":
        return 0 if index is None else _int("device", index, 0, _I32_MAX)
    raise InvalidArgument(f"cannot register memory on device '{device}': ferry handles host "
                          "memory and CUDA memory")


def _int_array(name: str, values: Any, what: str) -> np.ndarray:
    """np.asarray(values), with what numpy refuses (ragged nesting, ints past 64 bits, which
    numpy keeps as Python objects) named as the caller's argument."""
    if values is None or isinstance(values, (str, bytes)):
        raise InvalidType(f"{name}: {what} must be a sequence or array of integers, got "
                          f"{type(values).__name__}")
    try:
        a = np.asarray(values)
    except (ValueError, TypeError) as e:
        raise InvalidArgument(f"{name}: {what} must be a sequence or array of integers: "
                              f"{e}") from None
    if a.dtype == object:
        flat = a.ravel()
        bad = [v for v in flat if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
        if bad or a.ndim == 0:
            raise InvalidType(f"{name}: {what} must be integers, got "
                              f"{type(bad[0] if bad else values).__name__}")
        lo, hi = min(int(v) for v in flat), max(int(v) for v in flat)
        raise InvalidArgument(f"{name}: {what} must be in [0, {_U64_MAX}], got "
                              f"{lo if lo < 0 else hi}")
    return a


def _index_array(name: str, pages: Any, what: str = "page indices") -> np.ndarray:
    """Indices (pages, or what `what` says) as contiguous uint32, from a sequence or an integer
    numpy array / torch tensor."""
    if _is_tensor(pages):
        dtype = pages.dtype
        if getattr(dtype, "is_floating_point", False) or getattr(dtype, "is_complex", False) \
                or str(dtype) == "torch.bool":
            raise InvalidType(f"{name}: {what} must be integers, got a tensor of dtype {dtype}")
        pages = pages.detach().cpu().numpy()
    a = _int_array(name, pages, what)
    if a.size == 0:
        return np.empty(0, dtype=np.uint32)
    if a.dtype.kind not in "iu":
        raise InvalidType(f"{name}: {what} must be integers, got dtype {a.dtype}")
    if a.ndim != 1:
        raise InvalidArgument(f"{name}: {what} must be one-dimensional, got shape {a.shape}")
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi > _U32_MAX:
        raise InvalidArgument(f"{name}: {what} must be in [0, {_U32_MAX}], got "
                              f"{lo if lo < 0 else hi}")
    return np.ascontiguousarray(a, dtype=np.uint32)


def _runs_array(runs: Any) -> np.ndarray:
    """(src_offset, dst_offset, length) triples as an n x 3 uint64 array."""
    if _is_tensor(runs):
        runs = runs.detach().cpu().numpy()
    a = _int_array("runs", runs, "offsets and lengths")
    if a.size == 0:
        return np.empty((0, 3), dtype=np.uint64)
    if a.dtype.kind not in "iu":
        raise InvalidArgument(f"runs: offsets and lengths must be integers, got dtype {a.dtype}")
    if a.ndim != 2 or a.shape[1] != 3:
        raise InvalidArgument("runs must be (src_offset, dst_offset, length) triples, got "
                              f"shape {a.shape}")
    if int(a.min()) < 0:
        raise InvalidArgument(f"runs: offsets and lengths must be >= 0, got {int(a.min())}")
    return np.ascontiguousarray(a, dtype=np.uint64)


RemoteLike = Union[RemoteRegion, bytes, Region]
"""A destination (or read source): a RemoteRegion, a peer's descriptor bytes, or a Region
(its descriptor is used)."""

Pages = Any
"""Page indices: a sequence of ints, or a one-dimensional integer numpy array / torch tensor."""

Runs = Union[Sequence[Tuple[int, int, int]], Any]
"""Offset, offset, length triples, the offsets in the order of the call's regions
(write_runs: src_offset, dst_offset; read_runs: dst_offset, src_offset, as read() takes
them): a sequence, or an n x 3 integer array/tensor."""


def _remote(name: str, dst: RemoteLike) -> RemoteRegion:
    if isinstance(dst, RemoteRegion):
        return dst
    if isinstance(dst, (bytes, bytearray, memoryview)):
        return RemoteRegion.from_bytes(bytes(dst))
    if isinstance(dst, Region):
        return RemoteRegion.from_bytes(dst.descriptor)
    raise InvalidType(f"{name} must be a RemoteRegion or descriptor bytes, got "
                      f"{type(dst).__name__}")


def _region(name: str, r: Any) -> Region:
    if not isinstance(r, Region):
        raise InvalidType(f"{name} must be a Region from TransferEngine.register, got "
                          f"{type(r).__name__}")
    return r


class TransferEngine:
    """One-sided writes (with an optional 32-bit immediate the target counts), paged writes,
    multi-run writes and reads to peers over libfabric.

    Every operation returns an Op at once (GIL released while it is submitted); errors found
    before posting (bad descriptor, out of range) come back through Op.wait like any other.
    """

    def __init__(self, provider: str = "auto", *, same_host: bool = False,
                 node: str = "127.0.0.1", rails: int = 1, op_timeout: float = 10.0,
                 busy_poll: bool = False, stripe_threshold: int = 1 << 20,
                 max_write_size: int = 64 << 20, gpu_copy: str = "auto",
                 fabric_gpu_memory: bool = True, gpu_ipc: bool = True,
                 idle_spin_us: float = 200.0, wait_spin_us: Optional[float] = None,
                 rail_selection: str = "nearest", topology_xml: Optional[str] = None,
                 rail_nics: Optional[str] = None, cma_writes: bool = False,
                 rma_iovs: int = 4) -> None:
        """Creates an engine (EngineConfig in include/ferry/fabric/engine.h).

        provider: "auto" (efa > verbs > shm when same_host > tcp), "efa", "verbs", "tcp",
            "shm" or a full libfabric provider string.
        same_host: every peer is on this host (lets "auto" pick shm).
        node: local address the tcp and verbs providers bind.
        rails: NICs (domains) to open; large writes are striped over them.
        rail_selection: which NICs carry each region (EngineConfig::rails): "nearest" (a
            GPU's memory on the NICs under its PCIe switch, host memory on its NUMA node's;
            transfers go from those to the peer's NICs near its region), "all", or NIC domain
            names separated by commas ("rdmap79s0,rdmap80s0"; `ferry topo` lists them).
        topology_xml: the machine's PCIe tree as an hwloc XML file instead of this machine's.
        rail_nics: the NIC each rail stands for, one "<provider> <domain> <pci>" line per rail
            (tcp or shm rails standing in for a multi-NIC machine's NICs: tests).
        op_timeout: seconds (> 0) after which an operation not completed fails (a dead peer
            becomes an error, not a hang).
        busy_poll: workers never nap (lowest latency, one core per rail).
        stripe_threshold: bytes above which a write is split over the rails.
        max_write_size: longest piece (bytes, > 0) handed to the provider in one operation.
        gpu_copy: same-host GPU copies by "kernel", "copy-engine" or "auto".
        fabric_gpu_memory: register CUDA memory with the provider where it can (FI_HMEM).
        gpu_ipc: same-host GPU pairs copy over CUDA IPC (NVLink).
        cma_writes: on shm, write (above inject_size), write_runs and paged_write into a same-host
            peer's host region copy the bytes with one process_vm_writev on the calling
            thread (the call returns once they are in place), then signal the immediate
            through shm, instead of handing the write to the peer's worker. Both sides must
            turn it on (a region offers it when registered for peer writes by an engine with
            it on); off while FI_SHM_DISABLE_CMA=1. In place of shm's key check, each copy
            passes the peer's fence: a region the peer deregistered is refused (ferry.NotFound),
            bytes outside what it registered too, and its deregistration waits for copies
            already inside. A peer that refuses it (EPERM: ptrace scope, another user) gets
            shm's path, decided once and logged (EngineConfig::cma_writes).
        rma_iovs: runs of pages (paged_write) or runs (write_runs, read_runs) one fabric
            operation carries at most, one iovec each, where the provider takes that many (shm
            and tcp 4, efa 1); each such operation delivers one immediate (Op.imm_writes counts
            operations). On shm only writes with an immediate are joined (shm copies a read or
            a write without one from the initiator when it is one run). 1: one operation per
            run.
        idle_spin_us: how long workers spin after activity before napping.
        wait_spin_us: how long Op.wait, wait_imm and ImmExpectation.wait poll (GIL released)
            before they sleep until the worker wakes them: a wait that ends within it skips
            the wake-up, which was most of a small write's latency from Python, at the cost
            of a core while it polls. None (the default): 50 where this process may run on
            8 CPUs or more, else 0 (on 2 cores a polling waiter takes the core its engine's
            worker needs). Raises InvalidArgument for a negative, non-finite or non-numeric
            value, or one above 1000000 (a second).
        Raises Unavailable when the provider is missing, ferry.Error otherwise.
        """
        _log.sync_level()  # a level set just before takes effect for this engine's lines
        # The numbers of seconds and microseconds go as given: the extension checks them, as it
        # checks every timeout (python/src/convert.h).
        self._engine = _ferry.Engine(
            _str("provider", provider), _bool("same_host", same_host), _str("node", node),
            _int("rails", rails, 1, _I32_MAX), op_timeout,
            _bool("busy_poll", busy_poll), _uint("stripe_threshold", stripe_threshold),
            _uint("max_write_size", max_write_size), _str("gpu_copy", gpu_copy),
            _bool("fabric_gpu_memory", fabric_gpu_memory), _bool("gpu_ipc", gpu_ipc),
            idle_spin_us, _wait_spin_us(wait_spin_us),
            _str("rail_selection", rail_selection),
            "" if topology_xml is None else _str("topology_xml", topology_xml),
            "" if rail_nics is None else _str("rail_nics", rail_nics),
            _bool("cma_writes", cma_writes), _int("rma_iovs", rma_iovs, 1, 1 << 16))

    # Identity -----------------------------------------------------------------------------
    @property
    def address(self) -> bytes:
        """This engine's address: give it to peers, who pass it to connect()."""
        return self._engine.address

    @property
    def engine_id(self) -> int:
        """Random 64-bit id of this engine (its regions' descriptors carry it)."""
        return self._engine.engine_id

    @property
    def provider(self) -> str:
        """The libfabric provider in use, e.g. "tcp;ofi_rxm"."""
        return self._engine.provider

    @property
    def num_rails(self) -> int:
        """NICs (libfabric domains) the engine opened."""
        return self._engine.num_rails

    @property
    def health(self) -> Optional[str]:
        """None while every rail works. Once the engine's watchdog found a rail wedged inside
        libfabric (its worker spinning in one call, e.g. shm on a lock in shared memory that is
        never released), that error, for good: the rail's operations fail and it takes no new
        work, so make a new engine (a KvConnector on it fails its waiting transfers soon)."""
        why = self._engine.health
        return why or None

    @property
    def inject_size(self) -> int:
        """Largest write the provider copies while posting it (shm 4096, tcp 64 in libfabric
        1.17; 0 with inject off). With cma_writes, single writes up to it stay the
        provider's."""
        return self._engine.inject_size

    @property
    def rma_iovs(self) -> int:
        """Runs one fabric operation carries at most: the rma_iovs asked for, capped by the
        provider's limits (shm and tcp 4, efa 1)."""
        return self._engine.rma_iovs

    @property
    def supports_gpu_memory(self) -> bool:
        """True when the provider registers CUDA memory (FI_HMEM), so GPU regions reach peers
        on other hosts; same-host GPU peers use CUDA IPC either way."""
        return self._engine.supports_gpu_memory

    @property
    def wait_spin_us(self) -> float:
        """How long waits poll before they sleep: the constructor's value, or what None
        chose for this host."""
        return self._engine.wait_spin_us

    @property
    def gpu_memory_note(self) -> str:
        """Why or why not supports_gpu_memory."""
        return self._engine.gpu_memory_note

    def connect(self, address: bytes) -> Peer:
        """Connects to a peer by its address bytes (GIL released); the same peer twice gives
        the same id. Raises ProtocolError for bytes that are not an address."""
        if not isinstance(address, (bytes, bytearray, memoryview)):
            raise InvalidType("address must be the peer's TransferEngine.address bytes, "
                              f"got {type(address).__name__}")
        return Peer(self._engine.connect(bytes(address)))

    # Memory -------------------------------------------------------------------------------
    def register(self, obj: Any, *, read_only: bool = False) -> Region:
        """Registers memory and returns its Region (which keeps ``obj`` alive).

        obj: a numpy array or any buffer-protocol object (bytearray, memoryview, mmap...), a
            torch tensor (CPU or CUDA; read through data_ptr()/numel()/element_size()/device,
            without linking libtorch), or a raw (ptr, nbytes, device) tuple with device None,
            -1, "cpu", "cuda", "cuda:N" or N.
        read_only: accept a read-only buffer, usable only as a source (it has no descriptor).
        Raises InvalidArgument for a non-contiguous array/tensor, a read-only buffer, 0 bytes,
        a numpy array of Python objects, a sparse tensor; InvalidType for an object that is
        none of the above; Unavailable/InvalidArgument with ferry's message for CUDA memory
        where there is no GPU. The region keeps ``obj`` alive, but cannot stop a tensor's
        storage from being replaced: do not ``resize_()`` or ``set_()`` a registered tensor.
        """
        if isinstance(obj, tuple):
            if len(obj) != 3:
                raise InvalidArgument("a raw region is a (ptr, nbytes, device) tuple, got "
                                      f"{len(obj)} items")
            ptr, nbytes, device = obj
            return self._engine.register_ptr(_uint("ptr", ptr), _uint("nbytes", nbytes),
                                             _device_index(device), None,
                                             _bool("read_only", read_only))
        if _is_tensor(obj) and not isinstance(obj, np.ndarray):
            ptr = _tensor_data_ptr("obj", obj)
            if not obj.is_contiguous():
                raise InvalidArgument(
                    f"cannot register a non-contiguous tensor (shape {tuple(obj.shape)}, "
                    f"stride {tuple(obj.stride())}): ferry moves contiguous bytes; pass "
                    "t.contiguous()")
            nbytes = int(obj.element_size()) * int(obj.numel())
            return self._engine.register_ptr(ptr, nbytes,
                                             _device_index(obj.device), obj,
                                             _bool("read_only", read_only))
        return self._engine.register_buffer(obj, _bool("read_only", read_only))

    # Operations ---------------------------------------------------------------------------
    def write(self, peer: int, src: Region, src_offset: int, dst: RemoteLike, dst_offset: int,
              nbytes: int, imm: Optional[int] = None) -> Op:
        # The hot path for small writes: the extension's write parses exact types itself
        # (ints, Region, RemoteRegion, None or an int) without pybind11's dispatch, and raises
        # TypeError for anything else; only then are the arguments checked one by one here, to
        # convert what can be (descriptor bytes, numpy ints) and name the bad one.
        """Writes ``nbytes`` from ``src[src_offset:]`` to ``dst[dst_offset:]`` at ``peer``;
        with ``imm`` every piece carries it and Op.imm_writes says how many the target counts.
        An offset + nbytes past either region fails with OutOfRange before anything is sent."""
        try:
            return self._engine.write(peer, src, src_offset, dst, dst_offset, nbytes, imm)
        except TypeError:
            pass
        return self._engine.write(_uint("peer", peer, _U32_MAX), _region("src", src),
                                  _uint("src_offset", src_offset), _remote("dst", dst),
                                  _uint("dst_offset", dst_offset), _uint("nbytes", nbytes),
                                  _imm(imm))

    def paged_write(self, peer: int, src: Region, src_pages: Pages, src_stride: int,
                    dst: RemoteLike, dst_pages: Pages, dst_stride: int, page_bytes: int,
                    imm: Optional[int] = None, *, src_offset: int = 0,
                    dst_offset: int = 0) -> Op:
        """Copies page ``src_pages[i]`` (``page_bytes`` at src_offset + index * src_stride) to
        page ``dst_pages[i]`` (dst_offset + index * dst_stride); runs contiguous on both sides
        go as one write. A stride of 0 means page_bytes. Raises InvalidArgument for page lists
        that are not integers."""
        return self._engine.paged_write(
            _uint("peer", peer, _U32_MAX), _region("src", src),
            _index_array("src_pages", src_pages), _uint("src_stride", src_stride),
            _remote("dst", dst), _index_array("dst_pages", dst_pages),
            _uint("dst_stride", dst_stride), _uint("page_bytes", page_bytes),
            _uint("src_offset", src_offset), _uint("dst_offset", dst_offset), _imm(imm))

    def write_runs(self, peer: int, src: Region, dst: RemoteLike,
                   runs: Runs,
                   imm: Optional[int] = None) -> Op:
        """Writes each (src_offset, dst_offset, length) run as one operation with one
        completion; each run's writes carry ``imm``."""
        return self._engine.write_runs(_uint("peer", peer, _U32_MAX), _region("src", src),
                                       _remote("dst", dst), _runs_array(runs), _imm(imm))

    def read(self, peer: int, dst: Region, dst_offset: int, src: RemoteLike, src_offset: int,
             nbytes: int) -> Op:
        """Reads ``nbytes`` of the peer's ``src[src_offset:]`` into ``dst[dst_offset:]``. When
        the Op completes the bytes are in ``dst``."""
        return self._engine.read(_uint("peer", peer, _U32_MAX), _region("dst", dst),
                                 _uint("dst_offset", dst_offset), _remote("src", src),
                                 _uint("src_offset", src_offset), _uint("nbytes", nbytes))

    def read_runs(self, peer: int, dst: Region, src: RemoteLike,
                  runs: Runs) -> Op:
        # Offsets come in the order of the regions, as in read(): (dst_offset, src_offset,
        # length); the engine takes (src_offset, dst_offset, length).
        """Reads each (dst_offset in ``dst``, src_offset in the remote region, length) run, as
        one operation: the offsets in the order of the regions, as in read(). (Before
        2026-12-06 the runs were (src_offset, dst_offset, length).)"""
        local_first = _runs_array(runs)
        return self._engine.read_runs(_uint("peer", peer, _U32_MAX), _region("dst", dst),
                                      _remote("src", src),
                                      np.ascontiguousarray(local_first[:, [1, 0, 2]]))

    def signal(self, peer: int, imm: int) -> Op:
        """An immediate-only write (no bytes) the peer counts like any other."""
        return self._engine.signal(_uint("peer", peer, _U32_MAX), _uint("imm", imm, _U32_MAX))

    def answer_counts(self, count_imm: int, data_imm: int, ack_imm: int, peer: int,
                      box: Region, slots: int) -> None:
        """Target side of an acknowledged transfer, answered on the engine's worker until it
        closes: each write carrying ``count_imm`` says that the writer's running total of
        writes carrying ``data_imm`` is in one of the first ``slots`` 8-byte slots of ``box``
        (the highest of them counts); once that many arrived, ``ack_imm`` is signalled to
        ``peer``, answers in the order the counts came. What ferry.bench_peers ends ferry's
        transfers with, where Mooncake's end at its target's ack. ``box`` must stay open."""
        self._engine.answer_counts(_uint("count_imm", count_imm, _U32_MAX),
                                   _uint("data_imm", data_imm, _U32_MAX),
                                   _uint("ack_imm", ack_imm, _U32_MAX),
                                   _uint("peer", peer, _U32_MAX), _region("box", box),
                                   _uint("slots", slots))

    # Target side --------------------------------------------------------------------------
    def wait_imm(self, imm: int, count: int = 1, timeout: float = 10.0) -> None:
        """Waits (GIL released; polling for wait_spin_us, then sleeping) until ``count``
        writes carrying ``imm`` arrived and consumes them; raises TimeoutError naming the
        immediate and how many arrived otherwise. Arrivals accumulate per immediate, so
        consecutive rounds need no reset."""
        self._engine.wait_imm(_uint("imm", imm, _U32_MAX), _uint("count", count), timeout)

    def expect_imm(self, imm: int, count: int = 1, timeout: float = 600.0) -> ImmExpectation:
        """Arms an expectation of ``count`` writes carrying ``imm`` (consumed when complete),
        to poll with done() or wait() while doing other work; it fails with TimeoutError after
        ``timeout`` seconds."""
        return self._engine.expect_imm(_uint("imm", imm, _U32_MAX), _uint("count", count),
                                       timeout)

    def imm_available(self, imm: int) -> int:
        """Arrivals of ``imm`` not yet consumed."""
        return self._engine.imm_available(_uint("imm", imm, _U32_MAX))

    def stats(self) -> dict:
        """Counters: ops_posted, bytes_posted, eagain, op_errors, op_timeouts, imm_arrivals,
        messages_received, messages_dropped, and regions_registered (regions live now: one
        per Region not closed, plus those of KV connectors and all-to-alls on the engine), and
        rail_fallbacks (transfers with no rail near both memories, sent from this side's near
        NICs to the peer's near NICs of other indices), cma_bytes (bytes copied into same-host
        peers by process_vm_writev, cma_writes)."""
        return self._engine.stats()

    def rail_stats(self) -> List[dict]:
        """The same counters per rail, one dict per rail in rail order (rail_fallbacks is 0
        in each): which NICs carried the bytes (bytes_posted, ops_posted) and which received
        peers' writes with immediate data (imm_arrivals)."""
        return self._engine.rail_stats()

    # Lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the engine's workers and frees its fabric resources (GIL released); calls
        afterwards raise Cancelled. Also on leaving a ``with`` block."""
        self._engine.close()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        try:
            return f"ferry.TransferEngine(provider={self.provider!r}, id={self.engine_id:#x})"
        except Error:
            return "ferry.TransferEngine(closed)"
