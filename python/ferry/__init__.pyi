"""ferry: one-sided RDMA for LLM inference over libfabric, from Python (docs/PYTHON.md)."""

from typing import Any, List, Optional, Sequence, Tuple, Union

from ._ferry import (
    AlreadyExists as AlreadyExists,
    Cancelled as Cancelled,
    Error as Error,
    ImmExpectation as ImmExpectation,
    InternalError as InternalError,
    InvalidArgument as InvalidArgument,
    InvalidType as InvalidType,
    NotFound as NotFound,
    Op as Op,
    OutOfRange as OutOfRange,
    PermissionDenied as PermissionDenied,
    ProtocolError as ProtocolError,
    ProviderError as ProviderError,
    Region as Region,
    RemoteRegion as RemoteRegion,
    ResourceExhausted as ResourceExhausted,
    TimeoutError as TimeoutError,
    Unavailable as Unavailable,
)

__version__: str

RemoteLike = Union[RemoteRegion, bytes, Region]
"""A destination (or read source): a RemoteRegion, a peer's descriptor bytes, or a Region
(its descriptor is used)."""

Pages = Any
"""Page indices: a sequence of ints, or a one-dimensional integer numpy array / torch tensor."""

Runs = Union[Sequence[Tuple[int, int, int]], Any]
"""Offset, offset, length triples, the offsets in the order of the call's regions
(write_runs: src_offset, dst_offset; read_runs: dst_offset, src_offset, as read() takes
them): a sequence, or an n x 3 integer array/tensor."""

class Peer(int):
    """A connected peer: the engine's id for it, from TransferEngine.connect."""

def gpu_device_count() -> int:
    """CUDA devices visible to ferry (0 in builds without CUDA or without a GPU). Initialises
    CUDA in this process."""

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
                 rail_nics: Optional[str] = None) -> None:
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
    @property
    def address(self) -> bytes:
        """This engine's address: give it to peers, who pass it to connect()."""
    @property
    def engine_id(self) -> int:
        """Random 64-bit id of this engine (its regions' descriptors carry it)."""
    @property
    def provider(self) -> str:
        """The libfabric provider in use, e.g. "tcp;ofi_rxm"."""
    @property
    def num_rails(self) -> int:
        """NICs (libfabric domains) the engine opened."""
    @property
    def supports_gpu_memory(self) -> bool:
        """True when the provider registers CUDA memory (FI_HMEM), so GPU regions reach peers
        on other hosts; same-host GPU peers use CUDA IPC either way."""
    @property
    def gpu_memory_note(self) -> str:
        """Why or why not supports_gpu_memory."""
    @property
    def wait_spin_us(self) -> float:
        """How long waits poll before they sleep: the constructor's value, or what None
        chose for this host."""

    def connect(self, address: bytes) -> Peer:
        """Connects to a peer by its address bytes (GIL released); the same peer twice gives
        the same id. Raises ProtocolError for bytes that are not an address."""

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

    def write(self, peer: int, src: Region, src_offset: int, dst: RemoteLike, dst_offset: int,
              nbytes: int, imm: Optional[int] = None) -> Op:
        """Writes ``nbytes`` from ``src[src_offset:]`` to ``dst[dst_offset:]`` at ``peer``;
        with ``imm`` every piece carries it and Op.imm_writes says how many the target counts.
        An offset + nbytes past either region fails with OutOfRange before anything is sent."""

    def paged_write(self, peer: int, src: Region, src_pages: Pages, src_stride: int,
                    dst: RemoteLike, dst_pages: Pages, dst_stride: int, page_bytes: int,
                    imm: Optional[int] = None, *, src_offset: int = 0,
                    dst_offset: int = 0) -> Op:
        """Copies page ``src_pages[i]`` (``page_bytes`` at src_offset + index * src_stride) to
        page ``dst_pages[i]`` (dst_offset + index * dst_stride); runs contiguous on both sides
        go as one write. A stride of 0 means page_bytes. Raises InvalidArgument for page lists
        that are not integers."""

    def write_runs(self, peer: int, src: Region, dst: RemoteLike, runs: Runs,
                   imm: Optional[int] = None) -> Op:
        """Writes each (src_offset, dst_offset, length) run as one operation with one
        completion; each run's writes carry ``imm``."""

    def read(self, peer: int, dst: Region, dst_offset: int, src: RemoteLike, src_offset: int,
             nbytes: int) -> Op:
        """Reads ``nbytes`` of the peer's ``src[src_offset:]`` into ``dst[dst_offset:]``. When
        the Op completes the bytes are in ``dst``."""

    def read_runs(self, peer: int, dst: Region, src: RemoteLike, runs: Runs) -> Op:
        """Reads each (dst_offset in ``dst``, src_offset in the remote region, length) run, as
        one operation: the offsets in the order of the regions, as in read(). (Before
        2026-12-06 the runs were (src_offset, dst_offset, length).)"""

    def signal(self, peer: int, imm: int) -> Op:
        """An immediate-only write (no bytes) the peer counts like any other."""

    def answer_counts(self, count_imm: int, data_imm: int, ack_imm: int, peer: int,
                      box: Region, slots: int) -> None:
        """Target side of an acknowledged transfer, answered on the engine's worker until it
        closes: each write carrying ``count_imm`` says that the writer's running total of
        writes carrying ``data_imm`` is in one of the first ``slots`` 8-byte slots of ``box``
        (the highest of them counts); once that many arrived, ``ack_imm`` is signalled to
        ``peer``, answers in the order the counts came. What ferry.bench_peers ends ferry's
        transfers with, where Mooncake's end at its target's ack. ``box`` must stay open."""

    def wait_imm(self, imm: int, count: int = 1, timeout: float = 10.0) -> None:
        """Waits (GIL released; polling for wait_spin_us, then sleeping) until ``count``
        writes carrying ``imm`` arrived and consumes them; raises TimeoutError naming the immediate and how many arrived otherwise.
        Arrivals accumulate per immediate, so consecutive rounds need no reset."""

    def expect_imm(self, imm: int, count: int = 1, timeout: float = 600.0) -> ImmExpectation:
        """Arms an expectation of ``count`` writes carrying ``imm`` (consumed when complete),
        to poll with done() or wait() while doing other work; it fails with TimeoutError after
        ``timeout`` seconds."""

    def imm_available(self, imm: int) -> int:
        """Arrivals of ``imm`` not yet consumed."""

    def stats(self) -> dict:
        """Counters: ops_posted, bytes_posted, eagain, op_errors, op_timeouts, imm_arrivals,
        messages_received, messages_dropped, and regions_registered (regions live now: one
        per Region not closed, plus those of KV connectors and all-to-alls on the engine), and
        rail_fallbacks (transfers with no rail near both memories, sent from this side's near
        NICs to the peer's near NICs of other indices)."""

    def rail_stats(self) -> List[dict]:
        """The same counters per rail, one dict per rail in rail order (rail_fallbacks is 0
        in each): which NICs carried the bytes (bytes_posted, ops_posted) and which received
        peers' writes with immediate data (imm_arrivals)."""

    def close(self) -> None:
        """Stops the engine's workers and frees its fabric resources (GIL released); calls
        afterwards raise Cancelled. Also on leaving a ``with`` block."""

    def __enter__(self) -> "TransferEngine": ...
    def __exit__(self, *exc: Any) -> None: ...
