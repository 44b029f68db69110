"""ferry.kv: KV-cache transfer between a prefill engine and a decode engine, from Python.

A :class:`KvConnector` runs on a :class:`ferry.TransferEngine` over the engine's KV pool: one
tensor (``regions="one"``), one tensor per layer (vLLM's ``[2, num_blocks, block_size, heads,
head_dim]`` per layer, ``regions="per-layer"``) or a K and a V tensor per layer (SGLang's
buffers, ``regions="per-layer-kv"``), described by a :class:`KvLayout`. Two sides may use
different block sizes and region splits; ferry maps block ids to bytes on both.

Push (decode registers its blocks while prefill computes; prefill writes as the KV becomes
final): decode calls ``announce`` / ``register_push`` / ``cancel``, prefill calls
``prefill_scheduled`` / ``prefill_progress`` / ``prefill_done`` / ``prefill_failed``. Pull:
prefill's ``offer_pull`` returns bytes that decode passes to ``pull``. Results come back through
``poll()``, which the engine loop calls each step: a :class:`KvEvent` per finished send
(prefill may reuse the blocks), finished receive (decode's KV is complete, or why not),
scheduled announcement, or progress. ferry's thread never calls into Python; it queues events
that ``poll()`` drains. See docs/PYTHON.md.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, List, Optional, Sequence, Tuple, Union

from . import _ferry
from . import (
    _U32_MAX,
    AlreadyExists,
    InvalidArgument,
    TransferEngine,
    _device_index,
    _index_array,
    _is_tensor,
    _str,
    _tensor_data_ptr,
    _uint,
)
from ._ferry import HandshakeInfo, InvalidType, KvEvent, KvLayout, transfer_key

__all__ = ["KvLayout", "KvConfig", "KvConnector", "KvEvent", "HandshakeInfo", "HandshakeServer",
           "fetch_handshake", "pull_params", "transfer_key"]

TransferId = Union[int, str, bytes]
"""A transfer's id, the same on both sides: an int in [0, 2**64), or the engine's own request id
(a str, or bytes), whose 64-bit key is transfer_key(id). A name is kept by the connector while
the transfer is open on it (until its last event was polled): events carry it back as
KvEvent.request_id, and another name with the same 64-bit key is refused with InvalidArgument
meanwhile. Use names or ints on one connector, not both."""

Blocks = Any
"""Block ids in token order: a sequence of ints, or a one-dimensional integer numpy array /
torch tensor."""

Pool = Any
"""The KV pool: one tensor (regions="one"), a list of one tensor per layer (regions=
"per-layer", vLLM's [2, num_blocks, block_size, heads, head_dim]), or a list of 2 * layers
tensors, K before V, or of (K, V) pairs per layer (regions="per-layer-kv", SGLang's buffers).
Torch tensors (CPU or CUDA) or numpy arrays; each contiguous, with elements of the layout's
elem_size, at least layout.region_bytes long."""


def _tid(transfer_id: Any) -> Any:
    """A transfer id as the connector takes it: an int in [0, 2**64), or the engine's own name
    (str, or bytes; a bytearray or memoryview is copied to bytes)."""
    if isinstance(transfer_id, str):
        return transfer_id
    if isinstance(transfer_id, (bytes, bytearray, memoryview)):
        return bytes(transfer_id)
    if isinstance(transfer_id, bool) or not hasattr(transfer_id, "__index__"):
        raise InvalidType("transfer_id must be an int, a str or bytes (the engine's request "
                          f"id), got {type(transfer_id).__name__}")
    return _uint("transfer_id", transfer_id)


@dataclasses.dataclass
class KvConfig:
    """A connector's settings (ferry::kv::ConnectorConfig).

    tp_rank, tp_size: this rank's TP position (heads tp_rank * num_kv_heads onwards).
    lease: seconds a side holds blocks for a transfer that does not progress; a dead peer ends
        in an error event within it. Keep it above the engine's op_timeout.
    imm_base, imm_count: the immediates this connector uses on its engine
        ([imm_base, imm_base + imm_count) must end at or below 2**32).
    imm_span: immediates per push registration (one per prefill_progress chunk), at most 4096.
    pull_mode: "background" (reads planned on ferry's thread) or "inline" (in pull()).
    pull_keys: "offer" (offer_pull registers the offer's blocks on their own and closes them
        when the offer ends: a read with its parameters after that fails; the pool itself
        takes no peer reads, so parameters built with pull_params read nothing) or "pool" (the
        pool's keys, no registration per offer: needed where decode builds the parameters
        itself with pull_params).
    max_events: events kept until poll() (at least 1); beyond them events are dropped, and the
        next poll() ends with one KvEvent of kind "overflow" whose `dropped` counts them.
    """

    tp_rank: int = 0
    tp_size: int = 1
    lease: float = 30.0
    imm_base: int = 0x4B000000
    imm_count: int = 1 << 20
    imm_span: int = 64
    pull_mode: str = "background"
    # "offer": each offer_pull registers the offer's blocks on their own, closed when the offer
    # ends, so a read after that fails, and the pool itself takes no peer reads (parameters
    # built from the handshake, pull_params, read nothing); "pool": offers carry the pool's keys
    # (no registration per offer; what an engine whose decode builds the parameters needs).
    pull_keys: str = "offer"
    # Events kept until poll(), about 100 bytes each; beyond them, events are dropped and the
    # next poll() ends with an "overflow" event counting them. 65536 (about 6 MiB) holds more
    # than a step's events of 1000 push transfers reporting their 64 chunks each.
    max_events: int = 1 << 16


def _describe(obj: Any) -> str:
    if _is_tensor(obj):
        return f"{type(obj).__name__} of shape {tuple(obj.shape)} and dtype {obj.dtype}"
    shape = getattr(obj, "shape", None)
    return f"{type(obj).__name__}" + (f" of shape {tuple(shape)}" if shape is not None else "")


def _check_shape(name: str, obj: Any, layout: KvLayout) -> None:
    """A tensor with head and token axes must have them where the layout says: its last axes
    are [block_size, num_kv_heads, head_dim] (NHD) or [num_kv_heads, block_size, head_dim]
    (HND), the token axis possibly merged with the block axis (SGLang's [blocks * block_size,
    heads, head_dim]). A pool of the right bytes in another order was taken, and its KV
    scrambled without a word. Tensors of fewer than 3 axes carry no such shape: not checked."""
    shape = tuple(int(n) for n in getattr(obj, "shape", ()))
    if len(shape) < 3:
        return
    h, bs, d = layout.num_kv_heads, layout.block_size, layout.head_dim
    if layout.placement in ("head-joint", "head-joint-kt"):
        _check_head_joint_shape(name, shape, h, bs, d)
        return
    nhd = layout.order == "NHD"
    form = ("[..., block_size, num_kv_heads, head_dim]" if nhd
            else "[..., num_kv_heads, block_size, head_dim]")
    # (axis, what the layout says, the layout's field(s), allowed sizes)
    wanted = [(-1, "head_dim", (d,)),
              (-2, "num_kv_heads" if nhd else "block_size", (h,) if nhd else (bs,))]
    if not nhd:
        wanted.append((-3, "num_kv_heads", (h,)))
    elif len(shape) >= 4:
        wanted.append((-3, "block_size", (bs, bs * layout.num_blocks)))
    for axis, field, sizes in wanted:
        if shape[axis] not in sizes:
            raise InvalidArgument(
                f"{name}: shape {shape} does not match the layout: axis {len(shape) + axis} "
                f"(axis {axis}) is {shape[axis]}, the layout's {field} is {sizes[0]} "
                f"({layout.order}: {form}); a tensor with axes in another order holds other "
                "KV than the layout says")


def _check_head_joint_shape(name: str, shape: Tuple[int, ...], h: int, bs: int, d: int) -> None:
    """A head-joint pool keeps each (block, head)'s block_size K rows then its block_size V
    rows: [..., num_kv_heads, 2, block_size, head_dim], or vLLM's view of the same bytes
    [..., num_kv_heads, block_size, 2 * head_dim] (vLLM 0.32's CPU KV cache)."""
    forms = {"[..., num_kv_heads, 2, block_size, head_dim]": (h, 2, bs, d),
             "[..., num_kv_heads, block_size, 2 * head_dim]": (h, bs, 2 * d)}
    for want in forms.values():
        if len(shape) >= len(want) and shape[-len(want):] == want:
            return
    raise InvalidArgument(
        f"{name}: shape {shape} does not match the head-joint layout (num_kv_heads={h}, "
        f"block_size={bs}, head_dim={d}): its last axes must be "
        f"{' or '.join(forms)}; a tensor with axes in another order holds other KV than the "
        "layout says")


def _region_of(name: str, obj: Any, layout: KvLayout) -> Tuple[int, int, int]:
    """(ptr, nbytes, device) of one pool tensor or array, checked against the layout."""
    if _is_tensor(obj) and not hasattr(obj, "__array_interface__"):
        ptr, device = _tensor_data_ptr(name, obj), _device_index(obj.device)
        contiguous = bool(obj.is_contiguous())
        elem = int(obj.element_size())
        nbytes = elem * int(obj.numel())
        how = "t.contiguous()"
    elif hasattr(obj, "__array_interface__") and hasattr(obj, "ctypes"):
        contiguous = bool(obj.flags.c_contiguous)
        if not obj.flags.writeable:
            raise InvalidArgument(f"{name}: a read-only {_describe(obj)}: peers write into a KV "
                                  "pool; pass a writable array")
        if obj.dtype.hasobject:
            raise InvalidArgument(f"{name}: an array of Python objects (dtype {obj.dtype}): its "
                                  "bytes are object pointers; a KV pool holds numbers")
        elem, nbytes = int(obj.itemsize), int(obj.nbytes)
        ptr, device = int(obj.ctypes.data), -1
        how = "numpy.ascontiguousarray(a)"
    else:
        raise InvalidType(f"{name}: a KV pool is torch tensors or numpy arrays, got "
                          f"{type(obj).__name__}")
    if not contiguous:
        raise InvalidArgument(f"{name}: a non-contiguous {_describe(obj)}: a KV region must be "
                              f"one contiguous range of bytes; pass {how}")
    _check_shape(name, obj, layout)
    if elem != layout.elem_size:
        raise InvalidArgument(f"{name}: wrong dtype, a {_describe(obj)} has {elem}-byte "
                              f"elements but the layout says elem_size={layout.elem_size}")
    if nbytes < layout.region_bytes:
        raise InvalidArgument(
            f"{name}: region too small, a {_describe(obj)} holds {nbytes} bytes but one region "
            f"of the layout ({layout.regions}, {layout.num_layers} layers x {layout.num_blocks} "
            f"blocks of {layout.block_size} tokens) needs {layout.region_bytes}")
    return ptr, nbytes, device


def _refuse_overlaps(regions: List[Tuple[int, int, int]], layout: KvLayout) -> None:
    """Two pool tensors over the same bytes (``[torch.zeros(...)] * num_layers`` repeats one
    tensor) would make layers overwrite each other's KV, silently: refused, naming both."""
    spans = sorted((device, ptr, i) for i, (ptr, _, device) in enumerate(regions))
    for (d0, p0, i), (d1, p1, j) in zip(spans, spans[1:]):
        if d0 == d1 and p1 < p0 + layout.region_bytes:
            first, second = min(i, j), max(i, j)
            same = "is the same memory as" if p0 == p1 else "overlaps"
            raise InvalidArgument(
                f"pool[{second}] {same} pool[{first}]: each region of the pool needs bytes of "
                f"its own ({layout.region_bytes} per region), or layers overwrite each other's "
                "KV; a list built as [t] * n repeats one tensor n times")


def _pool_items(pool: Any, layout: KvLayout) -> Tuple[str, List[Any]]:
    """The pool's tensors in layout order (layer-major, K before V) and the split they make."""
    if not isinstance(pool, (list, tuple)):
        return "one", [pool]
    items = list(pool)
    if items and all(isinstance(p, (list, tuple)) for p in items):
        if any(len(p) != 2 for p in items):
            raise InvalidArgument("pool: per-layer (K, V) pairs must each hold two tensors")
        return "per-layer-kv", [t for kv in items for t in kv]
    if len(items) == layout.num_layers and layout.regions != "per-layer-kv":
        return "per-layer", items
    if len(items) == 2 * layout.num_layers:
        return "per-layer-kv", items
    raise InvalidArgument(
        f"pool: {len(items)} tensors for a layout of {layout.num_layers} layers: pass one "
        f"tensor, one per layer ({layout.num_layers}), one per layer and K/V "
        f"({2 * layout.num_layers}, K before V) or a (K, V) pair per layer")


def _blobs(name: str, items: Any, what: str) -> List[bytes]:
    """A list of bytes objects from one or a sequence of them (addresses, pull parameters)."""
    if isinstance(items, (bytes, bytearray, memoryview)):
        items = [items]
    if not isinstance(items, (list, tuple)):
        raise InvalidType(f"{name} must be a list of {what} (bytes), got "
                          f"{type(items).__name__}")
    out = []
    for i, a in enumerate(items):
        if not isinstance(a, (bytes, bytearray, memoryview)):
            raise InvalidType(f"{name}[{i}] must be {what} (bytes), got {type(a).__name__}")
        out.append(bytes(a))
    return out


def _addresses(name: str, ranks: Any) -> List[bytes]:
    return _blobs(name, ranks, "a TransferEngine.address")


class _Closing:
    """`with` support for the classes below: close() on exit."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class KvConnector(_Closing):
    """One engine rank's KV transfers, push and pull, on a TransferEngine.

    Registers the pool's tensors with the engine and keeps them (and the engine) alive until
    close(). Every call only validates and hands work to ferry's background thread, with the GIL
    released; results come back as KvEvents through poll(). Errors in the arguments raise
    ferry.Error subclasses naming the problem (a wrong dtype, a non-contiguous tensor, a region
    too small for the layout, a pool split other than layout.regions, a bad address or pull
    parameters); errors of the transfer itself (a dead peer, a lease that passed) come back as
    events. One connector per engine: it owns the engine's messages.
    """

    def __init__(self, engine: TransferEngine, layout: KvLayout, pool: Pool,
                 config: Optional[KvConfig] = None) -> None:
        """engine: the ferry.TransferEngine the KV moves on (one connector per engine).
        layout: this rank's KvLayout. pool: the engine's KV tensors (see Pool). config: a
        KvConfig (TP position, lease, immediates; default KvConfig())."""
        if not isinstance(engine, TransferEngine):
            raise InvalidType("engine must be a ferry.TransferEngine, got "
                              f"{type(engine).__name__}")
        if not isinstance(layout, KvLayout):
            raise InvalidType(f"layout must be a ferry.kv.KvLayout, got "
                              f"{type(layout).__name__}")
        config = KvConfig() if config is None else config
        if not isinstance(config, KvConfig):
            raise InvalidType(f"config must be a ferry.kv.KvConfig, got "
                              f"{type(config).__name__}")
        if config.pull_mode not in ("background", "inline"):
            raise InvalidArgument(f"pull_mode is 'background' or 'inline', got "
                                  f"{config.pull_mode!r}")
        if config.pull_keys not in ("offer", "pool"):
            raise InvalidArgument(f"pull_keys is 'offer' or 'pool', got {config.pull_keys!r}")
        split, items = _pool_items(pool, layout)
        if split != layout.regions:
            raise InvalidArgument(
                f"pool is split {split!r} ({len(items)} tensors) but the layout says regions="
                f"{layout.regions!r}: build KvLayout(..., regions={split!r}) for this pool")
        regions = [_region_of(f"pool[{i}]", t, layout) for i, t in enumerate(items)]
        _refuse_overlaps(regions, layout)
        args = (_uint("tp_rank", config.tp_rank, _U32_MAX),
                _uint("tp_size", config.tp_size, _U32_MAX), regions, list(items),
                _ferry.seconds(config.lease, "lease"),
                _uint("imm_base", config.imm_base, _U32_MAX),
                _uint("imm_count", config.imm_count, _U32_MAX),
                _uint("imm_span", config.imm_span, _U32_MAX), config.pull_mode == "inline",
                config.pull_keys == "pool", _uint("max_events", config.max_events))
        # The connector takes the engine's message handler: a second one would silently take
        # it from the first, whose transfers would then wait out their lease.
        ref = getattr(engine, "_kv_connector", None)
        other = ref() if ref is not None else None
        if other is not None and not other._closed:
            raise AlreadyExists("this TransferEngine has a KV connector already (one per "
                                "engine: it owns the engine's messages); close it first or "
                                "use another engine")
        self._closed = True  # until the C++ connector runs
        self._layout = layout
        self._conn = _ferry.KvConnector(engine._engine, layout, *args)
        self._closed = False
        engine._kv_connector = weakref.ref(self)

    @property
    def layout(self) -> KvLayout:
        """The layout the connector was built with."""
        return self._layout

    # Push, decode side --------------------------------------------------------------------
    def announce(self, transfer_id: TransferId, attempt: int,
                 prefill_ranks: Sequence[bytes]) -> None:
        """Before holding blocks: ask the prefill ranks (their TransferEngine.address, in rank
        order) to say when they schedule the transfer; a "scheduled" event follows."""
        self._conn.announce(_tid(transfer_id), _uint("attempt", attempt, _U32_MAX),
                            _addresses("prefill_ranks", prefill_ranks))

    def register_push(self, transfer_id: TransferId, attempt: int,
                      prefill_ranks: Sequence[bytes], blocks: Blocks, num_tokens: int, *,
                      first_token: int = 0) -> None:
        """Destination blocks (token order) for the transfer; prefill writes into them as the KV
        becomes final. A larger attempt supersedes a smaller one. A "recv" event ends it.

        first_token: tokens [first_token, num_tokens) move; this rank's prefix cache holds the
        ones before (vLLM's local hits). `blocks` then start at the block of token first_token
        (vLLM's newly allocated blocks), while prefill's blocks still start at token 0; the
        blocks before are neither read nor written. first_token == num_tokens moves nothing
        (blocks may be empty): the "recv" event comes once prefill released its blocks."""
        self._conn.register_push(_tid(transfer_id),
                                 _uint("attempt", attempt, _U32_MAX),
                                 _addresses("prefill_ranks", prefill_ranks),
                                 _index_array("blocks", blocks, "block ids"),
                                 _uint("num_tokens", num_tokens, _U32_MAX),
                                 _uint("first_token", first_token, _U32_MAX))

    def cancel(self, transfer_id: TransferId) -> None:
        # Idempotent by design (see above): an unknown id is vLLM's abort of a request never seen.
        """Stop the transfer; its "recv" event (code "cancelled") comes once no write can land
        any more, and only then may the blocks be reused. An id this connector has no transfer
        for (never registered, or already over) is a no-op with no event: vLLM's abort path
        reports requests the connector never saw. It does not stop a later register_push of
        that id."""
        self._conn.cancel(_tid(transfer_id))

    # Push, prefill side -------------------------------------------------------------------
    def prefill_scheduled(self, transfer_id: TransferId) -> None:
        """Prefill admitted the request: announced decode ranks may reserve their blocks."""
        self._conn.prefill_scheduled(_tid(transfer_id))

    def prefill_progress(self, transfer_id: TransferId, blocks: Blocks, tokens_ready: int, *,
                         partial_end: int = 0, partial_layers: int = 0) -> None:
        """Tokens [0, tokens_ready) are final (a chunk was computed), and [tokens_ready,
        partial_end) in layers [0, partial_layers): registered decode ranks get them now. Keep
        the blocks until the transfer's "send" event."""
        self._conn.prefill_progress(_tid(transfer_id),
                                    _index_array("blocks", blocks, "block ids"),
                                    _uint("tokens_ready", tokens_ready, _U32_MAX),
                                    _uint("partial_end", partial_end, _U32_MAX),
                                    _uint("partial_layers", partial_layers, _U32_MAX))

    def prefill_done(self, transfer_id: TransferId, blocks: Blocks, num_tokens: int) -> None:
        """The KV is computed: write it to the decode ranks that registered (or will, within the
        lease). A "send" event says when the blocks are free."""
        self._conn.prefill_done(_tid(transfer_id), _index_array("blocks", blocks, "block ids"),
                                _uint("num_tokens", num_tokens, _U32_MAX))

    def prefill_failed(self, transfer_id: TransferId, reason: str) -> None:
        """Prefill could not produce the KV: decode ranks get a failure carrying `reason`."""
        self._conn.prefill_failed(_tid(transfer_id), _str("reason", reason))

    def abort_send(self, transfer_id: TransferId, reason: str) -> None:
        """Give up a transfer after prefill_done / offer_pull (its other leg failed); its
        "send" event (carrying `reason`) says when the blocks are free. An id with no transfer
        here (never offered, or already over) is a no-op with no event, as for cancel()."""
        self._conn.abort_send(_tid(transfer_id), _str("reason", reason))

    # Pull ---------------------------------------------------------------------------------
    def offer_pull(self, transfer_id: TransferId, blocks: Blocks, num_tokens: int, *,
                   capability: Optional[bytes] = None) -> bytes:
        """Prefill: hold the blocks under the lease; returns what decode's pull() needs (hand it
        over through the router). A "send" event comes when decode finished reading.
        capability: 16 random bytes the caller drew (default: ferry draws them), for a decode
        side that builds its parameters with pull_params(); only a DONE carrying them frees
        the blocks."""
        return self._conn.offer_pull(_tid(transfer_id),
                                     _index_array("blocks", blocks, "block ids"),
                                     _uint("num_tokens", num_tokens, _U32_MAX),
                                     capability)

    def pull(self, transfer_id: TransferId, params: Union[bytes, Sequence[bytes]], blocks: Blocks,
             num_tokens: int, *, first_token: int = 0,
             live_offer_wait: Optional[float] = None) -> None:
        """Decode: read the KV from every prefill rank's offer_pull() bytes into `blocks`; a
        "recv" event ends it. first_token: only tokens [first_token, num_tokens) are read, and
        `blocks` start at that token's block (as for register_push).
        live_offer_wait: for parameters built with pull_params() (from the handshake): each
        prefill rank is first asked for its live offer's own parameters (the offer's keys,
        pull_keys="offer", and the lease it has left), waiting up to this many seconds for an
        offer not made yet. An offer that ended (its blocks may hold another request's KV
        now), a wrong capability or no offer in time fails the pull ("recv" event not ok) and
        nothing is read."""
        self._conn.pull(_tid(transfer_id),
                        _blobs("params", params, "what offer_pull returned"),
                        _index_array("blocks", blocks, "block ids"),
                        _uint("num_tokens", num_tokens, _U32_MAX),
                        _uint("first_token", first_token, _U32_MAX),
                        live_offer_wait)

    # Results ------------------------------------------------------------------------------
    def poll(self) -> List[KvEvent]:
        """Every event since the last poll, in the order ferry produced them; never blocks.
        Raises Cancelled once the connector is closed."""
        return self._conn.poll()

    def wait(self, timeout: float) -> bool:
        """Block (GIL released) until an event is queued or `timeout` seconds passed; True when
        one is there. Raises Cancelled once the connector is closed (also a wait in progress,
        when close() is called on another thread); Ctrl-C raises KeyboardInterrupt within
        0.1 s."""
        return self._conn.wait(timeout)

    def handshake_info(self) -> HandshakeInfo:
        """What this rank's HandshakeServer tells peers."""
        return self._conn.handshake_info()

    @property
    def open_names(self) -> int:
        """Transfer names (str or bytes ids) this connector keeps now: those of transfers whose
        last event was not polled yet."""
        return self._conn.open_names

    def stats(self) -> dict:
        """Counters (ferry::kv::ConnectorStats): transfers_sent/received/failed, ops_posted,
        bytes_posted, leases_expired, active_send/active_recv (transfers holding blocks)."""
        return self._conn.stats()

    # Lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel what still runs, unregister the pool, release the tensors; every call
        afterwards (poll and wait too) raises Cancelled, a second close() does nothing."""
        self._closed = True
        self._conn.close()


def _secret(secret: Any) -> bytes:
    if not isinstance(secret, (bytes, bytearray, memoryview)):
        raise InvalidType(f"secret must be bytes, got {type(secret).__name__}")
    return bytes(secret)


class HandshakeServer(_Closing):
    """The side channel of one connector: a small TCP service that tells peers proving the
    deployment secret (>= 16 bytes) this rank's engine address, pool and layout."""

    def __init__(self, connector: KvConnector, secret: bytes, host: str = "127.0.0.1",
                 port: int = 0, connection_deadline: float = 1.0) -> None:
        """connector: the KvConnector whose address, pool and layout are served. secret: the
        deployment secret (bytes, >= 16). host, port: where to listen (port 0: a free one, see
        .port). connection_deadline: seconds a peer may take to send its request."""
        if not isinstance(connector, KvConnector):
            raise InvalidType("connector must be a ferry.kv.KvConnector, got "
                              f"{type(connector).__name__}")
        self._server = _ferry.HandshakeServer(_str("host", host), _uint("port", port, 0xFFFF),
                                              connector.handshake_info(), _secret(secret),
                                              connection_deadline)

    @property
    def port(self) -> int:
        """The port listened on (a free one when 0 was asked)."""
        return self._server.port

    @property
    def epoch(self) -> int:
        """Random per server start: peers see a new value after a restart."""
        return self._server.epoch

    @property
    def requests_served(self) -> int:
        """Answers sent to peers that proved the secret."""
        return self._server.requests_served

    @property
    def auth_failures(self) -> int:
        """Connections refused: a peer without the secret (or garbage)."""
        return self._server.auth_failures

    def close(self) -> None:
        """Stops serving and joins the server's thread; a second close() does nothing."""
        self._server.close()


def pull_params(info: HandshakeInfo, transfer_id: TransferId, blocks: Blocks, num_tokens: int,
                capability: bytes, lease: float) -> bytes:
    """Decode: the bytes pull() takes, built from the prefill rank's HandshakeInfo (address,
    pool, layout, TP position) and what the request carried: the prefill rank's block ids,
    num_tokens, the 16-byte capability prefill offered them under (offer_pull(...,
    capability=)) and its lease in seconds. For engines whose prefill side answers the
    request before the process that holds the connector offers the blocks (vLLM)."""
    if not isinstance(info, HandshakeInfo):
        raise InvalidType(f"info must be the prefill rank's ferry.kv.HandshakeInfo, got "
                          f"{type(info).__name__}")
    tid = _tid(transfer_id)
    if not isinstance(tid, int):
        tid = transfer_key(tid)
    return _ferry.pull_params(info, tid, _index_array("blocks", blocks, "block ids"),
                              _uint("num_tokens", num_tokens, _U32_MAX), capability, lease)


def fetch_handshake(host: str, port: int, layout: KvLayout, secret: bytes,
                    timeout: float = 5.0) -> HandshakeInfo:
    """Ask a peer's HandshakeServer. Raises PermissionDenied when the secrets differ, an error
    naming both layouts when they are incompatible with `layout`, Unavailable or TimeoutError
    naming host:port when nobody answers."""
    if not isinstance(layout, KvLayout):
        raise InvalidType(f"layout must be this side's KvLayout, got {type(layout).__name__}")
    return _ferry.fetch_handshake(_str("host", host), _uint("port", port, 0xFFFF),
                                  layout, _secret(secret),
                                  timeout)
