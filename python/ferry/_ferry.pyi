"""Type stubs of ferry._ferry, the pybind11 extension. Use the ``ferry`` package: it checks
arguments and turns Python objects (tensors, arrays, page lists) into what this module takes."""

import builtins
from typing import Any, Callable, List, Optional, Tuple, Union

import numpy as np

class Error(RuntimeError):
    """Base of every ferry error (a RuntimeError); ``str(e)`` is ferry's message, ``e.code``
    the status code's name ("timeout", "out of range", ...)."""
    code: str

class InvalidArgument(Error, ValueError):
    """The caller passed something malformed or out of range."""

class InvalidType(InvalidArgument, TypeError):
    """An argument of the wrong type (None, a string where an int goes, a numpy array where a
    tensor goes): an InvalidArgument that is also a TypeError."""

class OutOfRange(Error, IndexError):
    """An access outside a registered region (rejected before anything is posted)."""

class NotFound(Error):
    """Unknown peer, region or descriptor."""

class TimeoutError(Error, builtins.TimeoutError):  # also caught by `except TimeoutError`
    """A deadline passed (an operation's op_timeout, or the timeout of a wait)."""

class Unavailable(Error):
    """Peer dead or unreachable, provider or GPU missing."""

class Cancelled(Error):
    """Cancelled by a user or by shutdown (a closed engine)."""

class ResourceExhausted(Error):
    """Out of a bounded resource."""

class ProtocolError(Error):
    """A blob that does not parse: truncated, corrupted, or from an incompatible build."""

class ProviderError(Error):
    """libfabric or CUDA reported an error."""

class PermissionDenied(Error, builtins.PermissionError):
    """The peer did not prove the deployment secret (KV handshake)."""

class AlreadyExists(Error):
    """Something with that id is live already (a transfer id in use)."""

class InternalError(Error):
    """A bug in ferry; please report it with the message."""

class RemoteRegion:
    """A peer's registered region, parsed from its descriptor bytes. Picklable."""
    @staticmethod
    def from_bytes(descriptor: Union[bytes, bytearray, memoryview]) -> RemoteRegion:
        """Parses ``Region.descriptor`` bytes of a peer; raises ProtocolError when they are
        truncated, corrupted or from an incompatible build, InvalidArgument when they are not
        bytes."""
    def to_bytes(self) -> bytes:
        """The descriptor bytes this was parsed from."""
    @property
    def engine_id(self) -> int:
        """Id of the engine that registered the region."""
    @property
    def length(self) -> int:
        """Size of the region in bytes."""
    @property
    def device(self) -> int:
        """CUDA device of GPU memory, -1 for host memory."""
    @property
    def is_gpu(self) -> bool:
        """True for CUDA memory."""

class Region:
    """Local memory registered with an engine; keeps the registered object alive and
    deregisters when garbage-collected or closed."""
    @property
    def descriptor(self) -> bytes:
        """What a peer needs to write into or read from this region (send it by any channel).
        Raises InvalidArgument for a read-only region."""
    @property
    def nbytes(self) -> int:
        """Size in bytes."""
    @property
    def data_ptr(self) -> int:
        """Address of byte 0."""
    @property
    def device(self) -> int:
        """CUDA device, or -1 for host memory."""
    @property
    def read_only(self) -> bool:
        """Registered with read_only=True: usable only as a source."""
    @property
    def owner(self) -> Any:
        """The registered object (array, tensor, buffer), or None for a raw pointer."""
    @property
    def closed(self) -> bool:
        """True after close()."""
    def close(self) -> None:
        """Deregisters now and drops the reference to the object. Operations using the
        region must have completed."""
    def __enter__(self) -> Region: ...
    def __exit__(self, *exc: Any) -> None:
        """Closes the region on leaving a ``with`` block."""

class Op:
    """Handle of one submitted operation. Keeps the regions it uses alive."""
    def done(self) -> bool:
        """True once the operation completed, successfully or not (never blocks)."""
    def wait(self, timeout: float = 30.0) -> None:
        """Waits up to ``timeout`` seconds, GIL released (polling for the engine's wait_spin_us
        before it sleeps). Returns when the operation
        succeeded; raises its error (OutOfRange, Unavailable, TimeoutError...) otherwise, or
        TimeoutError when ``timeout`` passed first. Completion of a write means the source may
        be reused; the bytes are known to be at the target once it counted the immediate.
        ``timeout``: a number of seconds in [0, 1e9], else InvalidArgument."""
    @property
    def imm_writes(self) -> int:
        """Number of writes carrying the immediate that this operation put on the wire: the
        count the target waits for (wait_imm / expect_imm)."""

class ImmExpectation:
    """Target-side expectation of ``count`` writes carrying ``imm``, consumed when complete."""
    imm: int
    """The immediate value expected."""
    count: int
    """How many writes carrying it are expected."""
    def done(self) -> bool:
        """True once the writes arrived (or the expectation's own timeout passed)."""
    def wait(self, timeout: float = 30.0) -> None:
        """Waits up to ``timeout`` seconds, GIL released (polling for the engine's wait_spin_us
        before it sleeps); raises TimeoutError if the writes are
        not all there (the expectation stays armed), or the expectation's error."""

class Engine:
    def __init__(self, provider: str, same_host: bool, node: str, rails: int,
                 op_timeout: float, busy_poll: bool, stripe_threshold: int,
                 max_write_size: int, gpu_copy: str, fabric_gpu_memory: bool, gpu_ipc: bool,
                 idle_spin_us: float, wait_spin_us: float, rail_selection: str,
                 topology_xml: str, rail_nics: str) -> None: ...
    address: bytes
    wait_spin_us: float
    engine_id: int
    provider: str
    num_rails: int
    supports_gpu_memory: bool
    gpu_memory_note: str
    def connect(self, address: bytes) -> int: ...
    def register_buffer(self, obj: Any, read_only: bool) -> Region: ...
    def register_ptr(self, ptr: int, nbytes: int, device: int, owner: Any,
                     read_only: bool) -> Region: ...
    def write(self, peer: int, src: Region, src_offset: int, dst: RemoteRegion,
              dst_offset: int, nbytes: int, imm: Optional[int]) -> Op:
        """Positional, exact types only (ints, a Region, a RemoteRegion, None or an int);
        TypeError otherwise. Parsed without pybind11's dispatch: the small-write hot path."""
    def paged_write(self, peer: int, src: Region, src_pages: np.ndarray, src_stride: int,
                    dst: RemoteRegion, dst_pages: np.ndarray, dst_stride: int, page_bytes: int,
                    src_offset: int, dst_offset: int, imm: Optional[int]) -> Op: ...
    def write_runs(self, peer: int, src: Region, dst: RemoteRegion, runs: np.ndarray,
                   imm: Optional[int]) -> Op: ...
    def read(self, peer: int, dst: Region, dst_offset: int, src: RemoteRegion,
             src_offset: int, nbytes: int) -> Op: ...
    def read_runs(self, peer: int, dst: Region, src: RemoteRegion, runs: np.ndarray) -> Op: ...
    def signal(self, peer: int, imm: int) -> Op: ...
    def wait_imm(self, imm: int, count: int, timeout: float) -> None: ...
    def expect_imm(self, imm: int, count: int, timeout: float) -> ImmExpectation: ...
    def answer_counts(self, count_imm: int, data_imm: int, ack_imm: int, peer: int,
                      box: Region, slots: int) -> None: ...
    def imm_available(self, imm: int) -> int: ...
    def stats(self) -> dict: ...
    def rail_stats(self) -> List[dict]: ...
    def close(self) -> None: ...

class MoeAllToAll:
    """One rank's C++ all-to-all (CPU backend or CUDA kernels); ferry.moe drives it with raw
    data pointers after checking every tensor."""
    def __init__(self, max_tokens: int, hidden: int, dtype: str, num_experts: int, topk: int,
                 rank: int, world: int, ranks_per_node: int, private_slots: int,
                 alignment: int, cuda: bool, device: int, engine: Optional[Engine],
                 allgather: Callable[[bytes], List[bytes]], timeout: float,
                 imm_offset: int = ...) -> None: ...
    is_cuda: bool
    max_expert_rows: int
    num_local_experts: int
    def dispatch_send(self, num_tokens: int, num_tokens_dev: int, x: int, x_scale: int,
                      indices: int, indices64: bool, weights: int, stream: int) -> None: ...
    def dispatch_recv(self, batch_x: int, batch_scale: int, offsets: int, counts: int,
                      out_x: int, out_scale: int, capacity: int, stream: int) -> None: ...
    def combine_send(self, expert_y: int, capacity: int, batch_y: int, offsets: int,
                     stream: int) -> None: ...
    def combine_recv(self, num_tokens: int, out: int, bf16: bool, weights: int,
                     stream: int) -> None: ...
    def synchronize(self, stream: int) -> None: ...
    def device_status(self) -> None: ...
    def close(self) -> None: ...

def moe_quantize_fp8(x: int, tokens: int, hidden: int, q: int, scales: int, cuda: bool,
                     stream: int) -> None: ...
def moe_dequantize_fp8(q: int, scales: int, tokens: int, hidden: int, out: int) -> None: ...
def cuda_host_gate(flag: int, want: int, timeout_s: float, stream: int) -> None:
    """Holds `stream` until the uint32 at `flag` (pinned host memory) is >= want (benchmarks)."""

class KvLayout:
    """Where each (layer, K/V, block, token, head) of one rank's pool lives (ferry::kv::KvLayout).

    placement: "separate" (per layer, K of all blocks then V: vLLM's [2, blocks, ...] per layer),
        "joint" ([blocks, 2, ...] per layer), "block-major" (each block holds every layer) or
        "head-joint" ([blocks, heads, 2, block_size, head_dim] per layer: each head's K rows then
        its V rows, vLLM 0.32's CPU backend; order "HND" only).
    order: "NHD" ([block_size, heads, head_dim] per block slab) or "HND".
    regions: "one", "per-layer" or "per-layer-kv": how the pool is split into tensors.
    Sizes are this rank's: num_kv_heads is the heads this TP rank holds. Raises InvalidArgument
    for zero sizes, unknown names and splits the placement does not keep contiguous. Two sides
    may differ in block size, heads per rank, order and split; head_dim and elem_size must agree
    (compatibility_hash).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, elem_size: int,
                 block_size: int, num_blocks: int, placement: str = "separate",
                 order: str = "NHD", regions: str = "one") -> None: ...
    num_layers: int
    """Transformer layers in the pool."""
    num_kv_heads: int
    """KV heads this TP rank holds."""
    head_dim: int
    """Elements per head."""
    elem_size: int
    """Bytes per element (2 for bf16/fp16)."""
    block_size: int
    """Tokens per block."""
    num_blocks: int
    """Blocks in the pool."""
    placement: str
    """"separate", "joint", "block-major" or "head-joint" (see the class)."""
    order: str
    """"NHD" or "HND" (see the class)."""
    regions: str
    """"one", "per-layer" or "per-layer-kv": how many tensors make the pool."""
    token_bytes: int
    """Bytes of one token's K (or V) across this rank's heads."""
    slab_bytes: int
    """Bytes of one block's K (or V) for one layer."""
    layer_bytes: int
    """Bytes of one layer's K and V over all blocks."""
    block_bytes: int
    """Bytes of one block's K and V over all layers."""
    pool_bytes: int
    """Bytes of the whole pool, all regions together."""
    region_count: int
    """Tensors the pool is made of (regions: 1, num_layers or 2 * num_layers)."""
    region_bytes: int
    """Bytes each pool tensor must hold at least."""
    compatibility_hash: int
    """What two sides must agree on (head_dim, elem_size); the handshake checks it."""
    def slab_offset(self, layer: int, part: int, block: int) -> int:
        """Pool byte offset of a (layer, K=0/V=1, block) slab; OutOfRange past the layout."""

class KvEvent:
    """What the connector reports, drained by KvConnector.poll().

    kind: "recv" (decode: the transfer attempt is over; ok means the KV is complete and intact,
        and either way the blocks are the engine's again), "send" (prefill: ferry no longer
        reads the blocks; free them), "scheduled" (decode: every prefill rank of an announce()
        scheduled the transfer, or why not), "progress" (decode, push: tokens [0, tokens) landed,
        plus [tokens, partial_end) in layers [0, partial_layers)), "overflow" (the last of a
        poll() when KvConfig.max_events were waiting and more came: `dropped` of them were not
        kept; its code is "resource exhausted").
    code: "ok" or the status code's name ("cancelled", "timeout", "unavailable", ...);
    message: ferry's message. bytes / writes: what this rank moved (recv, send).
    """

    kind: str
    """"recv", "send", "scheduled", "progress" or "overflow" (see the class)."""
    transfer_id: int
    """The transfer's 64-bit id: the int the calls gave, or transfer_key() of their name."""
    request_id: Union[int, str, bytes]
    """The transfer id as the calls gave it: the engine's name (str or bytes) or the int."""
    attempt: int
    """The attempt of the transfer this event is about."""
    ok: bool
    """Whether the transfer (or announcement) succeeded; see code and message if not."""
    code: str
    """"ok" or the status code's name ("cancelled", "timeout", "unavailable", ...)."""
    message: str
    """ferry's message: what failed and why ("" when ok)."""
    bytes: int
    """Bytes this rank moved (recv, send)."""
    writes: int
    """Writes this rank posted or counted (recv, send)."""
    tokens: int
    """progress: tokens [0, tokens) of every layer landed."""
    partial_end: int
    """progress: tokens [tokens, partial_end) landed in layers [0, partial_layers)."""
    partial_layers: int
    """progress: see partial_end."""
    dropped: int
    """overflow: events dropped since the previous poll() (0 for other kinds)."""
    def raise_if_error(self) -> None:
        """Raises the ferry.Error subclass of the event's status (nothing when ok)."""

class HandshakeInfo:
    """A rank's side-channel answer: how to reach it and what its pool looks like."""

    epoch: int
    """Random per server start: a new value means the peer restarted."""
    address: bytes
    """The rank's TransferEngine.address: pass it as a prefill_ranks entry."""
    pool: List[bytes]
    """One region descriptor per pool region, in layout order."""
    layout: KvLayout
    """The rank's KvLayout."""
    tp_rank: int
    """The rank's TP position."""
    tp_size: int
    """The TP size of the rank's engine."""
    def to_bytes(self) -> bytes:
        """This answer as bytes (what the handshake sends)."""
    @staticmethod
    def from_bytes(blob: Union[bytes, bytearray, memoryview]) -> HandshakeInfo:
        """Parses to_bytes() output; ProtocolError when it does not parse."""

class KvConnector:
    """ferry::kv::KvConnector over raw (ptr, nbytes, device) regions; ferry.kv checks the pool's
    tensors first. Events are queued by ferry's thread and drained by poll()."""
    def __init__(self, engine: Engine, layout: KvLayout, tp_rank: int, tp_size: int,
                 regions: List[Tuple[int, int, int]], owners: Any, lease: float, imm_base: int,
                 imm_count: int, imm_span: int, pull_inline: bool,
                 pull_pool_keys: bool, max_events: int) -> None: ...
    layout: KvLayout
    def announce(self, transfer_id: int, attempt: int, prefill_ranks: List[bytes]) -> None: ...
    def register_push(self, transfer_id: int, attempt: int, prefill_ranks: List[bytes],
                      blocks: np.ndarray, num_tokens: int) -> None: ...
    def cancel(self, transfer_id: int) -> None: ...
    def prefill_scheduled(self, transfer_id: int) -> None: ...
    def prefill_progress(self, transfer_id: int, blocks: np.ndarray, tokens: int,
                         partial_end: int, partial_layers: int) -> None: ...
    def prefill_done(self, transfer_id: int, blocks: np.ndarray, num_tokens: int) -> None: ...
    def prefill_failed(self, transfer_id: int, reason: str) -> None: ...
    def abort_send(self, transfer_id: int, reason: str) -> None: ...
    def offer_pull(self, transfer_id: int, blocks: np.ndarray, num_tokens: int) -> bytes: ...
    def pull(self, transfer_id: int, params: List[bytes], blocks: np.ndarray,
             num_tokens: int) -> None: ...
    def poll(self) -> List[KvEvent]: ...
    def wait(self, timeout: float) -> bool: ...
    def handshake_info(self) -> HandshakeInfo: ...
    def stats(self) -> dict: ...
    def close(self) -> None: ...

class HandshakeServer:
    def __init__(self, host: str, port: int, info: HandshakeInfo, secret: bytes,
                 connection_deadline: float) -> None: ...
    port: int
    epoch: int
    requests_served: int
    auth_failures: int
    def close(self) -> None: ...

def fetch_handshake(host: str, port: int, layout: KvLayout, secret: bytes,
                    timeout: float) -> HandshakeInfo: ...

def gpu_device_count() -> int: ...
