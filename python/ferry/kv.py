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
import sys
import weakref
from typing import Any, List, Optional, Sequence, Tuple, Union

from . import _docs, _ferry
from . import (
    _U32_MAX,
    AlreadyExists,
    InvalidArgument,
    TransferEngine,
    _device_index,
    _index_array,
    _is_tensor,
    _seconds,
    _str,
    _tensor_data_ptr,
    _uint,
)
from ._ferry import HandshakeInfo, InvalidType, KvEvent, KvLayout

__all__ = ["KvLayout", "KvConfig", "KvConnector", "KvEvent", "HandshakeInfo", "HandshakeServer",
           "fetch_handshake", "pull_params", "transfer_key"]

TransferId = Union[int, str, bytes]


def transfer_key(name: Union[str, bytes]) -> int:
    return _ferry.transfer_key(name)


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
    """A connector's settings (ferry::kv::ConnectorConfig)."""

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
    if layout.placement == "head-joint":
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
    """One engine rank's KV transfers, push and pull, on a TransferEngine it shares.

    The connector registers the pool's tensors with the engine and keeps them alive until
    :meth:`close`. It keeps the engine alive as well: the engine's threads stop when both the
    engine and its connectors are closed.
    """

    def __init__(self, engine: TransferEngine, layout: KvLayout, pool: Any,
                 config: Optional[KvConfig] = None) -> None:
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
                _seconds("lease", config.lease), _uint("imm_base", config.imm_base, _U32_MAX),
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
        return self._layout

    # Push, decode side --------------------------------------------------------------------
    def announce(self, transfer_id: TransferId, attempt: int,
                 prefill_ranks: Sequence[bytes]) -> None:
        self._conn.announce(_tid(transfer_id), _uint("attempt", attempt, _U32_MAX),
                            _addresses("prefill_ranks", prefill_ranks))

    def register_push(self, transfer_id: TransferId, attempt: int,
                      prefill_ranks: Sequence[bytes], blocks: Any, num_tokens: int, *,
                      first_token: int = 0) -> None:
        self._conn.register_push(_tid(transfer_id),
                                 _uint("attempt", attempt, _U32_MAX),
                                 _addresses("prefill_ranks", prefill_ranks),
                                 _index_array("blocks", blocks, "block ids"),
                                 _uint("num_tokens", num_tokens, _U32_MAX),
                                 _uint("first_token", first_token, _U32_MAX))

    def cancel(self, transfer_id: TransferId) -> None:
        # Idempotent by design (kv.pyi): an unknown id is vLLM's abort of a request never seen.
        self._conn.cancel(_tid(transfer_id))

    # Push, prefill side -------------------------------------------------------------------
    def prefill_scheduled(self, transfer_id: TransferId) -> None:
        self._conn.prefill_scheduled(_tid(transfer_id))

    def prefill_progress(self, transfer_id: TransferId, blocks: Any, tokens_ready: int, *,
                         partial_end: int = 0, partial_layers: int = 0) -> None:
        self._conn.prefill_progress(_tid(transfer_id),
                                    _index_array("blocks", blocks, "block ids"),
                                    _uint("tokens_ready", tokens_ready, _U32_MAX),
                                    _uint("partial_end", partial_end, _U32_MAX),
                                    _uint("partial_layers", partial_layers, _U32_MAX))

    def prefill_done(self, transfer_id: TransferId, blocks: Any, num_tokens: int) -> None:
        self._conn.prefill_done(_tid(transfer_id), _index_array("blocks", blocks, "block ids"),
                                _uint("num_tokens", num_tokens, _U32_MAX))

    def prefill_failed(self, transfer_id: TransferId, reason: str) -> None:
        self._conn.prefill_failed(_tid(transfer_id), _str("reason", reason))

    def abort_send(self, transfer_id: TransferId, reason: str) -> None:
        self._conn.abort_send(_tid(transfer_id), _str("reason", reason))

    # Pull ---------------------------------------------------------------------------------
    def offer_pull(self, transfer_id: TransferId, blocks: Any, num_tokens: int, *,
                   capability: Optional[bytes] = None) -> bytes:
        return self._conn.offer_pull(_tid(transfer_id),
                                     _index_array("blocks", blocks, "block ids"),
                                     _uint("num_tokens", num_tokens, _U32_MAX),
                                     _capability(capability))

    def pull(self, transfer_id: TransferId, params: Union[bytes, Sequence[bytes]], blocks: Any,
             num_tokens: int, *, first_token: int = 0) -> None:
        self._conn.pull(_tid(transfer_id),
                        _blobs("params", params, "what offer_pull returned"),
                        _index_array("blocks", blocks, "block ids"),
                        _uint("num_tokens", num_tokens, _U32_MAX),
                        _uint("first_token", first_token, _U32_MAX))

    # Results ------------------------------------------------------------------------------
    def poll(self) -> List[KvEvent]:
        return self._conn.poll()

    def wait(self, timeout: float) -> bool:
        return self._conn.wait(_seconds("timeout", timeout))

    def handshake_info(self) -> HandshakeInfo:
        return self._conn.handshake_info()

    @property
    def open_names(self) -> int:
        return self._conn.open_names

    def stats(self) -> dict:
        return self._conn.stats()

    # Lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        self._closed = True
        self._conn.close()


def _secret(secret: Any) -> bytes:
    if not isinstance(secret, (bytes, bytearray, memoryview)):
        raise InvalidType(f"secret must be bytes, got {type(secret).__name__}")
    return bytes(secret)


class HandshakeServer(_Closing):
    """The side channel of one connector: tells peers that prove the deployment secret its
    engine address, pool descriptors, layout and TP position."""

    def __init__(self, connector: KvConnector, secret: bytes, host: str = "127.0.0.1",
                 port: int = 0, connection_deadline: float = 1.0) -> None:
        if not isinstance(connector, KvConnector):
            raise InvalidType("connector must be a ferry.kv.KvConnector, got "
                              f"{type(connector).__name__}")
        self._server = _ferry.HandshakeServer(_str("host", host), _uint("port", port, 0xFFFF),
                                              connector.handshake_info(), _secret(secret),
                                              _seconds("connection_deadline",
                                                       connection_deadline))

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def epoch(self) -> int:
        return self._server.epoch

    @property
    def requests_served(self) -> int:
        return self._server.requests_served

    @property
    def auth_failures(self) -> int:
        return self._server.auth_failures

    def close(self) -> None:
        self._server.close()


def _capability(capability: Any) -> Optional[bytes]:
    if capability is None:
        return None
    if not isinstance(capability, (bytes, bytearray, memoryview)):
        raise InvalidType(f"capability must be 16 bytes, got {type(capability).__name__}")
    capability = bytes(capability)
    if len(capability) != 16:
        raise InvalidArgument(f"capability must be 16 bytes, got {len(capability)}")
    return capability


def pull_params(info: HandshakeInfo, transfer_id: TransferId, blocks: Any, num_tokens: int,
                capability: bytes, lease: float) -> bytes:
    if not isinstance(info, HandshakeInfo):
        raise InvalidType(f"info must be the prefill rank's ferry.kv.HandshakeInfo, got "
                          f"{type(info).__name__}")
    tid = _tid(transfer_id)
    if not isinstance(tid, int):
        tid = transfer_key(tid)
    cap = _capability(capability)
    if cap is None:
        raise InvalidType("capability must be 16 bytes, got None")
    return _ferry.pull_params(info, tid, _index_array("blocks", blocks, "block ids"),
                              _uint("num_tokens", num_tokens, _U32_MAX), cap,
                              _seconds("lease", lease))


def fetch_handshake(host: str, port: int, layout: KvLayout, secret: bytes,
                    timeout: float = 5.0) -> HandshakeInfo:
    if not isinstance(layout, KvLayout):
        raise InvalidType(f"layout must be this side's KvLayout, got {type(layout).__name__}")
    return _ferry.fetch_handshake(_str("host", host), _uint("port", port, 0xFFFF),
                                  layout, _secret(secret),
                                  _seconds("timeout", timeout))


_docs.attach(sys.modules[__name__], "kv.pyi")
