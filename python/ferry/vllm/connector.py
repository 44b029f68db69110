"""FerryConnector: vLLM's KV connector interface (KVConnectorBase_V1, vLLM 0.32) over ferry.kv.

vLLM builds one instance per process: the scheduler half (role SCHEDULER, in the engine-core
process) decides what moves and passes it to the worker half (role WORKER, in each worker
process) as FerryConnectorMetadata each step; the worker half owns a ferry.TransferEngine, a
ferry.kv.KvConnector over vLLM's own KV tensors (registered as they are, no copy) and the
HandshakeServer that tells peers its address. docs/VLLM.md has the whole flow; the call order of
one vLLM step is in vLLM's kv_connector_model_runner_mixin.py.

Push (mode "push", the default): the client (a proxy) sends the same prompt to a prefill engine
with kv_transfer_params {"do_remote_decode": true, "ferry_transfer_id": T} and to a decode engine
with {"do_remote_prefill": true, "ferry_transfer_id": T, "remote_host": H, "remote_port": P}
(the prefill engine's side channel, "kv_connector_extra_config" host/port), at the same time.
Decode's scheduler reports the prompt's tokens as loadable asynchronously; once vLLM allocated
its blocks (update_state_after_alloc) its worker registers them with the prefill engine
(KvConnector.register_push, transfer id T). Prefill computes the prompt; when the request
finishes (request_finished) its blocks are kept and its worker calls prefill_done, which writes
the KV into decode's blocks on ferry's threads. Decode's request runs once ferry reports the
transfer complete; a transfer that fails is reported to vLLM as a failed receive
(KVConnectorTransferResults.failed_recving), so vLLM's kv_load_failure_policy applies
("recompute": decode computes the prompt itself; "fail": the request ends with an error).
While prefill computes the request (vLLM scheduled it), ferry renews both sides' leases.

Pull (mode "pull", or kv_transfer_params {"ferry_mode": "pull"} on the prefill leg): the proxy
sends the prefill leg first; prefill's request_finished keeps the blocks and answers with
kv_transfer_params for decode (its side channel, remote_block_ids, remote_num_tokens, a fresh
16-byte ferry_capability, ferry_expires), and its worker offers the blocks under that
capability (KvConnector.offer_pull) in the next step. The proxy passes the answer's params to
decode unchanged; decode's worker builds the request's parameters from prefill's handshake
(ferry.kv.pull_params), asks prefill's connector for the live offer's own parameters (its
keys, pull_keys="offer", waiting a bounded time for a worker that has not offered yet) and
reads the blocks on ferry's threads (KvConnector.pull, live_offer_wait): a replayed request,
or one whose offer ended, is refused and reads nothing.

Each step's transfers start in bind_connector_metadata, before the forward: vLLM 0.32 calls
start_load_kv only after the forward when all loads are asynchronous.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under "vllm." so that vLLM's logging configuration prints it with its own lines.
logger = init_logger("vllm.ferry_connector")

# The kv_transfer_params names this connector reads (besides vLLM's do_remote_prefill /
# do_remote_decode, remote_host, remote_port).
TRANSFER_ID = "ferry_transfer_id"
ATTEMPT = "ferry_attempt"
REMOTE_TP = "remote_tp_size"
MODE = "ferry_mode"  # "push" or "pull": a prefill request's mode (default: the engine's)
# Pull: what prefill's request_finished returns for decode (vLLM's names where it has them).
REMOTE_BLOCKS = "remote_block_ids"
REMOTE_TOKENS = "remote_num_tokens"
CAPABILITY = "ferry_capability"  # 32 hex digits: authorises decode's DONE for these blocks
EXPIRES = "ferry_expires"  # wall-clock seconds (time.time()) after which prefill's offer ends

# A secret every process of a one-machine deployment shares when the config names none; a
# deployment across machines must set "secret" (or FERRY_KV_SECRET) to its own.
_LOCAL_SECRET = b"ferry-vllm-local-only-secret"

_MAX_TRANSFER_ID = (1 << 63) - 1
# How long a worker whose step computes nothing waits for ferry's next event while transfers are
# open (get_transfer_results). vLLM steps again at once when a step schedules no tokens: a decode
# engine whose requests all wait for pushed KV spins through empty steps, 0.87 of a core in the
# sweep at 8k tokens QPS 1 against 0.18 in pull, taken from prefill's compute on a small host.
# The wait ends as soon as an event arrives, so a transfer's end is not delayed; a request that
# reaches the engine meanwhile is, by at most this much.
IDLE_WAIT = 0.005


class FerryConfigError(ValueError):
    """A kv_connector_extra_config or kv_transfer_params value ferry cannot use."""


@dataclasses.dataclass
class FerryOptions:
    """kv_connector_extra_config, with the defaults that work on one machine."""

    mode: str = "push"  # "push" or "pull": what a prefill request does unless it says
    provider: str = "tcp"  # ferry.TransferEngine provider: tcp, shm, verbs, efa, auto
    host: str = "127.0.0.1"  # this engine's side channel (HandshakeServer)
    port: int = 7710  # this engine's side channel: port + tp_rank per worker
    lease: float = 30.0  # seconds a transfer may stall before it fails (ferry.kv.KvConfig)
    op_timeout: float = 10.0  # seconds one transfer operation may take
    rails: int = 1  # NICs (rails) the engine opens (ferry.TransferEngine rails)
    # Which rails carry a region's bytes: "nearest" (by topology), "all", or a comma-separated
    # NIC list (ferry.TransferEngine rail_selection, docs/ARCHITECTURE.md "Rails")
    rail_selection: str = "nearest"
    # Push: prefill writes each layer's KV as its forward computes it (save_kv_layer), rather
    # than the whole request when it finishes; CPU KV caches only (see FerryConnector.
    # save_kv_layer). false: whole requests.
    layerwise: bool = True
    # provider "shm": a push write's bytes are copied by prefill's thread into decode's memory
    # (process_vm_writev; ferry.TransferEngine cma_writes) rather than by decode's worker, as
    # libfabric's shm does; both engines must set it. Off by default: the copy checks no key at
    # decode (docs/PROTOCOL.md, "Same-host writes by process_vm_writev").
    cma_writes: bool = False
    secret: bytes = _LOCAL_SECRET

    @classmethod
    def from_extra(cls, extra: Optional[Dict[str, Any]]) -> "FerryOptions":
        extra = dict(extra or {})
        o = cls()
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise FerryConfigError(
                f"FerryConnector: unknown kv_connector_extra_config keys {unknown}; known: "
                f"{sorted(known)}")
        o.mode = str(extra.get("mode", o.mode))
        if o.mode not in ("push", "pull"):
            raise FerryConfigError(
                f"FerryConnector: mode {o.mode!r} is neither \"push\" nor \"pull\"")
        o.provider = str(extra.get("provider", o.provider))
        o.host = str(extra.get("host", o.host))
        try:
            o.port = int(extra.get("port", o.port))
            o.lease = float(extra.get("lease", o.lease))
            o.op_timeout = float(extra.get("op_timeout", o.op_timeout))
            o.rails = int(extra.get("rails", o.rails))
        except (TypeError, ValueError) as e:
            raise FerryConfigError(f"FerryConnector: kv_connector_extra_config: {e}") from None
        if not 0 < o.port < 65536:
            raise FerryConfigError(f"FerryConnector: port {o.port} is not a TCP port")
        if o.rails < 1:
            raise FerryConfigError(f"FerryConnector: rails must be at least 1, got {o.rails}")
        o.rail_selection = str(extra.get("rail_selection", o.rail_selection))
        o.layerwise = _flag(extra, "layerwise", o.layerwise)
        o.cma_writes = _flag(extra, "cma_writes", o.cma_writes)
        secret = extra.get("secret", os.environ.get("FERRY_KV_SECRET"))
        if secret is not None:
            o.secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        return o


def _flag(extra: Dict[str, Any], key: str, default: bool) -> bool:
    """A true/false key of kv_connector_extra_config (JSON booleans; "true"/"false"/"1"/"0")."""
    value = extra.get(key, default)
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        value = value.lower() in ("true", "1")
    if not isinstance(value, bool):
        raise FerryConfigError(f"FerryConnector: {key} must be true or false, got {value!r}")
    return value


def transfer_id_of(params: Optional[Dict[str, Any]]) -> Optional[int]:
    """The explicit transfer id a request's kv_transfer_params carry, or None when they carry
    none (the request is not a disaggregated one). Raises FerryConfigError for a value that is
    not an integer in [1, 2**63)."""
    if not params or TRANSFER_ID not in params:
        return None
    tid = params[TRANSFER_ID]
    if isinstance(tid, bool) or not isinstance(tid, int) or not 0 < tid <= _MAX_TRANSFER_ID:
        raise FerryConfigError(f"kv_transfer_params: {TRANSFER_ID} must be an integer in "
                               f"[1, 2**63), got {tid!r}")
    return tid


def transfer_key(tid: int, prompt_token_ids) -> int:
    """The id ferry moves a request's KV under: the client's transfer id bound to the prompt
    (SHA-256 of both, 63 bits). Prefill and decode derive it each from its own request, so a
    decode request naming another request's transfer id (forged, or a proxy's mistake) names
    another transfer: it never receives that request's KV, and its load fails by the lease."""
    import hashlib

    h = hashlib.sha256(b"ferry-vllm-transfer\0%d\0" % tid)
    h.update(b",".join(b"%d" % t for t in (prompt_token_ids or ())))
    return (int.from_bytes(h.digest()[:8], "little") & _MAX_TRANSFER_ID) or 1


# remote_tp_size a decode request may name: each rank costs one handshake inside vLLM's step.
_MAX_REMOTE_TP = 64


@dataclasses.dataclass
class RecvSpec:
    """Decode: register these blocks for transfer `transfer_id` from the prefill engine."""

    req_id: str
    transfer_id: int
    attempt: int
    block_ids: List[int]
    num_tokens: int
    remote_host: str
    remote_port: int
    remote_tp: int
    # Decode's own prefix-cache hit: tokens [0, first_token) are in decode's blocks already
    # and do not move; block_ids start at first_token's block (whole blocks: vLLM's hits are).
    first_token: int = 0
    # Pull: prefill's blocks (same block size), capability and when its offer ends; None: push.
    remote_blocks: Optional[List[int]] = None
    capability: bytes = b""
    expires: float = 0.0


@dataclasses.dataclass
class OfferSpec:
    """Prefill, pull: hold these blocks for decode to read, under this capability."""

    req_id: str
    transfer_id: int
    block_ids: List[int]
    num_tokens: int
    capability: bytes


@dataclasses.dataclass
class LayerSpec:
    """Prefill, push: this step computes the request's prompt up to `num_tokens`, tokens
    [0, first_token) having been final (and written) before it. The step that completes the
    prompt (`final`) has each layer written as soon as the forward computed it; an earlier
    chunk is written once its last layer is computed, while the next chunk computes."""

    req_id: str
    transfer_id: int
    block_ids: List[int]
    num_tokens: int
    first_token: int = 0
    final: bool = True


@dataclasses.dataclass
class SendSpec:
    """Prefill: the request's KV is computed; write it to whoever registered `transfer_id`."""

    req_id: str
    transfer_id: int
    block_ids: List[int]
    num_tokens: int


@dataclasses.dataclass
class FerryConnectorMetadata(KVConnectorMetadata):
    """What the scheduler half tells the worker half in one step."""

    recv: List[RecvSpec] = dataclasses.field(default_factory=list)
    send: List[SendSpec] = dataclasses.field(default_factory=list)
    offer: List[OfferSpec] = dataclasses.field(default_factory=list)
    # (req_id, transfer_id): prefill requests vLLM scheduled (allocated): ferry renews decode's
    # lease while they compute, however long that takes.
    scheduled: List[Tuple[str, int]] = dataclasses.field(default_factory=list)
    # Push prefill requests this step computes a chunk of, or the rest of: written as the
    # forward computes them (LayerSpec).
    layers: List[LayerSpec] = dataclasses.field(default_factory=list)
    # (req_id, transfer_id, reason, hold): prefill requests aborted before their KV was
    # computed. hold: some of their KV was written already (a chunk, or layers), writes may
    # still read their blocks, and vLLM keeps the blocks until the worker reports the send over.
    fail_send: List[Tuple[str, int, str, bool]] = dataclasses.field(default_factory=list)
    # (req_id, transfer_id): prefill requests vLLM preempted (their blocks freed) after some of
    # their KV was written: the transfer fails, and the worker waits for its writes to end
    # before this step's forward may write into those blocks.
    preempted: List[Tuple[str, int]] = dataclasses.field(default_factory=list)
    # (req_id, transfer_id): decode requests finished (aborted) while their KV was on the way.
    cancel_recv: List[Tuple[str, int]] = dataclasses.field(default_factory=list)
    started: bool = False  # the worker's: this step's transfers were started
    # The step computes no tokens (vLLM's total_num_scheduled_tokens is 0): the worker may wait
    # for ferry's events instead of returning at once (IDLE_WAIT).
    idle: bool = False


# ---------------------------------------------------------------------------------------------
# ferry's byte counters in vLLM's metrics: the worker reports what moved since its last report
# (get_kv_connector_stats), vLLM carries it to its API server, which adds it to Prometheus
# counters (/metrics: vllm:ferry_bytes_received_total, vllm:ferry_bytes_posted_total,
# vllm:ferry_layer_writes_total).
# The API server also states the connector's config there, as an info gauge that `ferry serve
# router --engines vllm` reads at readiness: vllm:ferry_connector_info{mode, host, port, tp_size}
# 1 (the mode of its prefill requests and the side channel decode engines reach it at).

STAT_NAMES = {
    "bytes_received": "KV bytes that arrived in this engine's blocks (decode: push writes "
                      "counted, pull reads)",
    "bytes_posted": "KV bytes this engine posted (prefill: push writes; decode: pull reads)",
    "layer_writes": "prefill, push: layers of requests written as the forward computed them "
                    "(layerwise), before the request finished",
    "chunk_writes": "prefill, push: chunks of prompts computed in several steps (chunked "
                    "prefill) written while the next chunk computed",
    "engine_renewals": "new ferry engines opened because the last one lost its rail (a worker "
                       "spinning inside libfabric: TransferEngine.health)",
}


@dataclasses.dataclass
class FerryStats(KVConnectorStats):
    """Counter increments since the last report, by STAT_NAMES key."""

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "FerryStats":
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> Dict[str, Any]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class FerryPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            k: create_metric_per_engine(
                self._counter_cls(name=f"vllm:ferry_{k}", documentation=doc,
                                  labelnames=labelnames), per_engine_labelvalues)
            for k, doc in STAT_NAMES.items()}
        # Built in the API server's process (vLLM's PrometheusStatLogger), from the same config
        # the engine core's connector reads.
        o = FerryOptions.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        info = self._gauge_cls(
            name="vllm:ferry_connector_info",
            documentation="FerryConnector's config: the mode of its prefill requests and its "
                          "side channel (host, port of TP rank 0, tp_size); always 1",
            labelnames=labelnames + ["mode", "host", "port", "tp_size"],
            multiprocess_mode="mostrecent")
        tp = vllm_config.parallel_config.tensor_parallel_size
        for values in per_engine_labelvalues.values():
            info.labels(*values, o.mode, o.host, str(o.port), str(tp)).set(1)

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0):
        for k, v in (transfer_stats_data or {}).items():
            per_engine = self._counters.get(k)
            if per_engine is not None and engine_idx in per_engine and v > 0:
                per_engine[engine_idx].inc(v)


# ---------------------------------------------------------------------------------------------
# Layout: what vLLM's KV tensors look like, read from their shapes and strides.


def _pull_fields(params: Dict[str, Any], num_tokens: int):
    """(prefill's block ids, capability, expiry) of a pull request's kv_transfer_params, or
    ValueError naming what is wrong. Prefill's blocks are of its own block size, which may
    differ from decode's: ferry checks their number against prefill's layout when it plans the
    reads. prefill's remote_num_tokens must be this engine's token count for the prompt."""
    blocks = params[REMOTE_BLOCKS]
    if not isinstance(blocks, list) or not 0 < len(blocks) <= max(num_tokens, 1) or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 1 << 32
            for b in blocks):
        raise ValueError(f"{REMOTE_BLOCKS} must be 1 to {num_tokens} block ids for this prompt")
    tokens = params.get(REMOTE_TOKENS)
    if tokens != num_tokens:
        raise ValueError(f"{REMOTE_TOKENS} {tokens!r} is not this engine's {num_tokens} for "
                         "this prompt (an engine whose KV pages move whole, head-joint, needs "
                         "the same block size on both sides)")
    try:
        cap = bytes.fromhex(str(params[CAPABILITY]))
    except ValueError:
        cap = b""
    if len(cap) != 16:
        raise ValueError(f"{CAPABILITY} must be 32 hex digits")
    expires = float(params.get(EXPIRES, 0.0))
    return list(blocks), cap, expires


def mismatch(peer, peer_rank: int, peer_tp: int, own, own_tp: int, want_rank: int,
             want_tp: int) -> str:
    """Why a prefill rank's KV layout (its handshake: `peer`, its TP position) cannot move into
    this engine's (`own`, TP `own_tp`), naming both sides' values; "" when ferry maps it.
    (head_dim, layer count and element size are checked by fetch_handshake already, the KV
    heads in all by register_push and pull, each naming both sides' values.) ferry maps
    block sizes, TP degrees and the placements it knows; it cannot map opaque CPU pages
    ("head-joint": vLLM's CPU kernels other than "vec") into another block size or layout."""
    if (peer_rank, peer_tp) != (want_rank, want_tp):
        return (f"its side channel serves TP rank {peer_rank} of {peer_tp}, the request's "
                f"remote_tp_size names rank {want_rank} of {want_tp}")
    opaque = "head-joint" in (peer.placement, own.placement)
    if opaque and (peer.placement, peer.block_size) != (own.placement, own.block_size):
        return (f"prefill's pages are {peer.placement} of block size {peer.block_size}, this "
                f"engine's {own.placement} of block size {own.block_size}: vLLM's CPU pages "
                "packed for kernels other than \"vec\" (head-joint) move only whole, into the "
                "same layout and block size")
    return ""


def _layer_index(name: str) -> int:
    m = re.search(r"\.(\d+)\.", name) or re.search(r"(\d+)", name)
    return int(m.group(1)) if m else 0


def cpu_page_placement(dtype: torch.dtype, block_size: int, head_dim: int,
                       kv_cache_dtype: Optional[str] = None) -> str:
    """The ferry placement of vLLM's CPU KV pages ([blocks, heads, block_size, 2 * head_dim]
    per layer) for the attention kernel vLLM picks for them: "head-joint-kt" for its vector
    kernel (ISA "vec": each head's K page stored dimension-major, [head_dim][block_size], then
    its V rows), whose tokens ferry maps one by one (other block sizes, partial blocks);
    "head-joint" for the others (AMX, NEON, vec16, ...: packed in ways ferry does not map),
    whose pages move whole between engines of the same block size only."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, block_size, head_dim, kv_cache_dtype)
    except Exception:  # noqa: BLE001 - no CPU backend here (or another vLLM): pages opaque
        isa = None
    return "head-joint-kt" if isa == "vec" else "head-joint"


def moves_exact_tokens(vllm_config: "VllmConfig") -> bool:
    """Whether this engine's KV pages map token by token (every layout but opaque CPU pages),
    so a transfer moves exactly the prompt's tokens, whatever the peer's block size; else
    whole blocks move, and both engines need the same block size. The scheduler's answer
    must be the worker's (layout_of): both follow cpu_page_placement."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return True
        mc = vllm_config.model_config
        return cpu_page_placement(mc.dtype, vllm_config.cache_config.block_size,
                                  mc.get_head_size(),
                                  vllm_config.cache_config.cache_dtype) == "head-joint-kt"
    except Exception:  # noqa: BLE001 - a config without a model (a unit test): whole blocks
        return False


def _kv_cache_on_cpu(vllm_config: "VllmConfig") -> bool:
    """Whether this engine's KV caches are in host memory (vLLM's CPU platform), where a layer's
    KV is written when save_kv_layer is called; a GPU forward is still queued on its stream."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001 - no platform (a unit test): as the worker finds it
        return True


def layout_of(tensors: List[torch.Tensor], *, num_blocks: int, block_size: int, num_kv_heads: int,
              head_dim: int, page_placement: str = "head-joint"):
    """(ferry.kv.KvLayout, pool) for vLLM's per-layer KV tensors, or FerryConfigError naming
    the shape, strides and what was expected.

    Recognised, per layer (vLLM's logical shape; the tensor must be contiguous in it):
      [num_blocks, heads, block_size, 2 * head_dim]  vLLM 0.32's KV cache view ([B, H, N, C]
          with C = K and V of one head); the CPU backend keeps a (block, head) page's K, then
          its block_size V rows: placement `page_placement` (cpu_page_placement), order HND.
      [2, num_blocks, block_size, heads, head_dim]   separate, NHD (older flash-attention)
      [2, num_blocks, heads, block_size, head_dim]   separate, HND
      [num_blocks, 2, block_size, heads, head_dim]   joint, NHD (FlashInfer)
      [num_blocks, 2, heads, block_size, head_dim]   joint, HND
    """
    import ferry.kv as fkv

    t0 = tensors[0]
    shape, elem = tuple(t0.shape), t0.element_size()
    B, N, H, D = num_blocks, block_size, num_kv_heads, head_dim
    patterns = {
        (B, H, N, 2 * D): (page_placement, "HND"),
        (2, B, N, H, D): ("separate", "NHD"),
        (2, B, H, N, D): ("separate", "HND"),
        (B, 2, N, H, D): ("joint", "NHD"),
        (B, 2, H, N, D): ("joint", "HND"),
    }
    what = (f"a KV cache tensor of shape {shape}, strides {tuple(t0.stride())}, dtype {t0.dtype} "
            f"(vLLM's config: {B} blocks of {N} tokens, {H} KV heads of head_dim {D})")
    if shape not in patterns:
        raise FerryConfigError(f"FerryConnector: cannot read {what}: the shape is none of "
                               f"{sorted(patterns)}")
    for i, t in enumerate(tensors):
        if tuple(t.shape) != shape or t.element_size() != elem:
            raise FerryConfigError(f"FerryConnector: layer {i} differs from layer 0: "
                                   f"{tuple(t.shape)} {t.dtype}, not {what}")
        if not t.is_contiguous():
            raise FerryConfigError(
                f"FerryConnector: layer {i} is not contiguous in its logical shape: {what} "
                f"(strides {tuple(t.stride())}); set VLLM_KV_CACHE_LAYOUT to a layer-compact "
                "layout or report the backend")
    placement, order = patterns[shape]
    layout = fkv.KvLayout(num_layers=len(tensors), num_kv_heads=H, head_dim=D, elem_size=elem,
                          block_size=N, num_blocks=B, placement=placement, order=order,
                          regions="per-layer")
    return layout, list(tensors)


# ---------------------------------------------------------------------------------------------


class FerryConnector(KVConnectorBase_V1):
    """ferry's KV connector for vLLM: load it with
    {"kv_connector": "FerryConnector", "kv_connector_module_path": "ferry.vllm"}."""

    # Tokens this connector loads came from another vLLM instance (vllm:prompt_tokens_by_source
    # counts them as external_kv_transfer, prompt_tokens_cached_by_source as p2p).
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._opts = FerryOptions.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self._block_size = vllm_config.cache_config.block_size
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _Scheduler(self._opts, self._block_size,
                                     vllm_config.parallel_config.tensor_parallel_size,
                                     exact_tokens=moves_exact_tokens(vllm_config),
                                     layerwise=_kv_cache_on_cpu(vllm_config))
            self._worker = None
        else:
            self._sched = None
            self._worker = _Worker(self._opts, vllm_config, kv_cache_config)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]):
        assert self._worker is not None
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # The step's transfers start here, before its forward: vLLM 0.32 calls start_load_kv
        # only after the forward when every load is asynchronous
        # (kv_connector_model_runner_mixin.py), so a prefill reported scheduled there had
        # computed its prompt already, its leases unrenewed (issue 32), and sends and reads
        # waited a whole forward. What starts here is queued for ferry's threads (the first
        # handshake with a peer excepted).
        if self._worker is not None and isinstance(connector_metadata, FerryConnectorMetadata):
            self._worker.start(connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        return  # started in bind_connector_metadata, before the forward

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # push: the KV is complete before vLLM schedules the request

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        # vLLM calls this after each attention layer's forward wrote the layer's KV: push
        # requests whose prompt this step completes have that layer written now, on ferry's
        # threads, while the next layers compute (the rest, and DONE, at request_finished).
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, FerryConnectorMetadata) and meta.layers:
            self._worker.layer_computed(layer_name, meta.layers)

    def wait_for_save(self):
        return  # sends run on ferry's threads; blocks are kept until get_transfer_results

    def get_transfer_results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        meta = self._connector_metadata
        idle = isinstance(meta, FerryConnectorMetadata) and meta.idle
        return self._worker.results(wait=IDLE_WAIT if idle else 0.0)

    def get_finished(self, finished_req_ids: Set[str]):
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None
                                 ) -> Optional[KVConnectorStats]:
        return FerryStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: Dict[type, type],
                           labelnames: List[str], per_engine_labelvalues: Dict[int, List[object]]
                           ) -> Optional[KVConnectorPromMetrics]:
        return FerryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        # Failed loads are reported per request (failed_recving), which vLLM handles for every
        # KV cache group layout; block ids would only repeat them.
        return set()

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        assert self._sched is not None
        return self._sched.matched(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> Tuple[int, ...]:
        # The request's own blocks arrive whole, in every group: vLLM must not zero any of them
        # while the transfer writes (the default, the prefix-cacheable groups, is none when
        # prefix caching is off).
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int):
        assert self._sched is not None
        self._sched.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._sched is not None
        self._sched.note_step(scheduler_output)
        meta = self._sched.take_meta()
        meta.idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        assert self._sched is not None
        self._sched.on_output(connector_output)

    def request_finished(self, request: "Request",
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        assert self._sched is not None
        return self._sched.finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.pending()

    def get_finished_count(self) -> Optional[int]:
        return None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        return None  # any layout layout_of() reads


class _Scheduler:
    """The scheduler half: which requests send or receive, handed to the workers per step."""

    def __init__(self, opts: FerryOptions, block_size: int, tp_size: int = 1,
                 exact_tokens: bool = False, layerwise: bool = True):
        self._opts = opts
        # Writes as the forward computes (FerryOptions.layerwise), where the worker can: CPU KV
        # caches (a GPU forward is still queued on its stream when save_kv_layer runs).
        self._layerwise = opts.layerwise and layerwise
        self._block_size = block_size
        self._tp_size = tp_size
        # True: transfers move exactly the prompt's tokens (both engines count them alike,
        # whatever their block sizes); False: whole blocks (opaque CPU pages, moves_exact_tokens).
        self._exact = exact_tokens
        self._meta = FerryConnectorMetadata()
        self._recv: Dict[str, int] = {}  # decode: req_id -> transfer id, until its KV is there
        self._sending: Set[str] = set()  # prefill: req_ids whose blocks ferry still reads
        self._refused: Set[str] = set()  # decode: req_ids whose params were refused
        # decode: req_ids whose transfer failed; vLLM's recompute policy reschedules them with
        # nothing computed, and they must then compute, not wait for the same transfer again.
        self._load_failed: Set[str] = set()
        # prefill, push: req_id -> transfer key of requests reported scheduled
        self._computing: Dict[str, int] = {}
        # prefill, push: requests computed in chunks, not complete yet: req_id -> (prompt
        # tokens, the block ids vLLM gave it so far)
        self._chunked: Dict[str, Tuple[int, List[int]]] = {}
        # prefill, push: requests some of whose KV went out before they finished (a chunk, or
        # layers of the step completing the prompt): their blocks may be read by ferry's writes
        self._written: Set[str] = set()
        # prefill, push: requests preempted after some of their KV went out: their transfer
        # failed (decode's load fails by its policy); they compute again and send nothing
        self._abandoned: Set[str] = set()

    def _params(self, request: "Request") -> Optional[Dict[str, Any]]:
        return request.kv_transfer_params

    def matched(self, request: "Request", num_computed_tokens: int):
        params = self._params(request)
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        try:
            tid = transfer_id_of(params)
        except FerryConfigError as e:
            if request.request_id not in self._refused:
                logger.warning("FerryConnector: request %s: %s; computing it locally",
                               request.request_id, e)
                self._refused.add(request.request_id)
            return 0, False
        if tid is None or request.request_id in self._recv or \
                request.request_id in self._load_failed:
            return 0, False
        prompt = len(request.prompt_token_ids or ())
        # Decode's own prefix-cache hits (num_computed_tokens, whole blocks: vLLM presents the
        # block-aligned part of its local hit) stay; only the tokens after them move
        # (update_state_after_alloc registers from there on).
        count = prompt - num_computed_tokens
        if count <= 0:
            return 0, False
        return count, True

    def after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        params = self._params(request)
        if params and params.get("do_remote_decode") and \
                params.get(MODE, self._opts.mode) == "push" and \
                request.request_id not in self._computing and \
                request.request_id not in self._abandoned:
            # Prefill: the request computes from now on (its lease renewed meanwhile).
            try:
                tid = transfer_id_of(params)
            except FerryConfigError:
                tid = None  # refused in request_finished, with the reason
            if tid is not None:
                key = transfer_key(tid, request.prompt_token_ids)
                self._computing[request.request_id] = key
                self._meta.scheduled.append((request.request_id, key))
            return
        if not params or num_external_tokens <= 0 or not params.get("do_remote_prefill"):
            return
        tid = transfer_id_of(params)
        if tid is None or request.request_id in self._recv:
            return
        prompt = len(request.prompt_token_ids or ())
        block_ids = list(blocks.get_block_ids()[0])
        need = -(-prompt // self._block_size)
        key = transfer_key(tid, request.prompt_token_ids)
        # The request's blocks start with decode's own prefix-cache hit (whole blocks, the
        # prompt's tokens less what get_num_new_matched_tokens said would arrive): those stay,
        # and the transfer writes (or reads) the blocks after them only.
        hit = max(0, prompt - num_external_tokens) // self._block_size
        try:
            spec = RecvSpec(req_id=request.request_id, transfer_id=key,
                            attempt=int(params.get(ATTEMPT, 1)), block_ids=block_ids[hit:need],
                            num_tokens=self._tokens(prompt),
                            remote_host=str(params["remote_host"]),
                            remote_port=int(params["remote_port"]),
                            remote_tp=int(params.get(REMOTE_TP, 1)),
                            first_token=hit * self._block_size)
            if not 0 < spec.remote_tp <= _MAX_REMOTE_TP or not 0 < spec.remote_port < 65536:
                raise ValueError(f"remote_port {spec.remote_port} / {REMOTE_TP} "
                                 f"{spec.remote_tp} out of range")
            if REMOTE_BLOCKS in params:  # prefill offered its blocks: decode reads them
                spec.remote_blocks, spec.capability, spec.expires = _pull_fields(
                    params, spec.num_tokens)
        except (KeyError, TypeError, ValueError) as e:
            spec = RecvSpec(req_id=request.request_id, transfer_id=key, attempt=1,
                            block_ids=block_ids[:need], num_tokens=self._tokens(prompt),
                            remote_host="",
                            remote_port=0, remote_tp=0)
            logger.warning("FerryConnector: request %s: kv_transfer_params lack %s", request
                           .request_id, e)
        self._recv[request.request_id] = key
        self._meta.recv.append(spec)

    def _tokens(self, prompt: int) -> int:
        """Tokens a transfer of a `prompt`-token request moves: the prompt's, or its whole
        blocks' where pages move whole."""
        return prompt if self._exact else -(-prompt // self._block_size) * self._block_size

    def note_step(self, out: "SchedulerOutput"):
        """Push prefill requests this step computes prompt tokens of: the worker writes them as
        the forward computes them (FerryOptions.layerwise). A step that completes the prompt
        has each layer written once computed; a chunk of a prompt computed in several steps
        (vLLM's chunked prefill) is written once its last layer is, while the next chunk
        computes. A request preempted after some of its KV went out gives its transfer up."""
        if not self._layerwise:
            return
        for req_id in getattr(out, "preempted_req_ids", None) or ():
            self._chunked.pop(req_id, None)
            if req_id in self._written and req_id in self._computing:
                # vLLM freed its blocks, and may give them to another request in this very
                # step: the worker fails the transfer and waits for its writes before the
                # forward. Recomputed later, the request may well give the same KV, but
                # decode holds tokens of the first computation: no mixing.
                self._written.discard(req_id)
                self._abandoned.add(req_id)
                self._meta.preempted.append((req_id, self._computing.pop(req_id)))
        if not self._computing:
            return
        counts = getattr(out, "num_scheduled_tokens", None) or {}
        for new in getattr(out, "scheduled_new_reqs", None) or ():
            key = self._computing.get(new.req_id)
            if key is None:
                continue
            blocks = list(new.block_ids[0]) if new.block_ids else []
            self._chunk(new.req_id, key, len(new.prompt_token_ids or ()), blocks,
                        new.num_computed_tokens, counts.get(new.req_id, 0))
        cached = getattr(out, "scheduled_cached_reqs", None)
        for i, req_id in enumerate(getattr(cached, "req_ids", None) or ()):
            chunked = self._chunked.get(req_id)
            key = self._computing.get(req_id)
            if chunked is None or key is None:
                continue
            prompt, blocks = chunked
            added = cached.new_block_ids[i]
            if added is not None:
                if req_id in cached.resumed_req_ids:
                    blocks = list(added[0])
                else:
                    blocks = blocks + list(added[0])
            self._chunk(req_id, key, prompt, blocks, cached.num_computed_tokens[i],
                        counts.get(req_id, 0))

    def _ready(self, tokens: int, prompt: int) -> int:
        """What a transfer can move once `tokens` of a `prompt`-token request are computed:
        those tokens, or its whole blocks among them where pages move whole."""
        if tokens >= prompt:
            return self._tokens(prompt)
        return tokens if self._exact else tokens // self._block_size * self._block_size

    def _chunk(self, req_id: str, key: int, prompt: int, blocks: List[int], computed: int,
               scheduled: int):
        """This step computes tokens [computed, computed + scheduled) of the request."""
        if prompt == 0 or scheduled <= 0 or computed >= prompt:
            return  # nothing of the prompt (a decode step)
        end = min(computed + scheduled, prompt)
        need = -(-end // self._block_size)
        if len(blocks) < need:
            return  # not vLLM's way; the whole prompt still goes at request_finished
        final = end == prompt
        if final:
            self._chunked.pop(req_id, None)
        else:
            self._chunked[req_id] = (prompt, blocks)
        first, last = self._ready(computed, prompt), self._ready(end, prompt)
        if last <= first:
            return  # no whole block yet (pages that move whole)
        self._written.add(req_id)
        self._meta.layers.append(LayerSpec(req_id, key, list(blocks[:need]), last, first, final))

    def take_meta(self) -> FerryConnectorMetadata:
        meta, self._meta = self._meta, FerryConnectorMetadata()
        return meta

    def on_output(self, out: "KVConnectorOutput"):
        for req_id in out.finished_sending or ():
            self._sending.discard(req_id)
        for req_id in out.finished_recving or ():
            self._recv.pop(req_id, None)
        for req_id in out.failed_recving or ():
            self._load_failed.add(req_id)

    def finished(self, request: "Request", block_ids: List[int]):
        params = self._params(request) or {}
        req_id = request.request_id
        self._refused.discard(req_id)
        self._load_failed.discard(req_id)
        self._computing.pop(req_id, None)
        self._chunked.pop(req_id, None)
        written = req_id in self._written
        self._written.discard(req_id)
        if req_id in self._abandoned:
            # Preempted after some of its KV went out: the transfer failed then (decode's load
            # fails by its policy); this computation's KV goes nowhere.
            self._abandoned.discard(req_id)
            return False, None
        if req_id in self._recv:
            # Decode, aborted while its KV was on the way: vLLM keeps the blocks until the
            # receive is reported over, which the worker does once ferry cancelled it.
            self._meta.cancel_recv.append((req_id, self._recv[req_id]))
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        try:
            tid = transfer_id_of(params)
        except FerryConfigError as e:
            logger.warning("FerryConnector: request %s: %s; not sending its KV", req_id, e)
            return False, None
        if tid is None:
            return False, None
        from vllm.v1.request import RequestStatus

        prompt = len(request.prompt_token_ids or ())
        need = -(-prompt // self._block_size)
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED) or len(block_ids) < need:
            # Some of its KV went out already: ferry's writes may still read its blocks, which
            # vLLM keeps until the worker reports the send over (the writes ended).
            self._meta.fail_send.append(
                (req_id, transfer_key(tid, request.prompt_token_ids),
                 f"prefill request ended as {request.status.name} before its KV was complete",
                 written))
            return written, None
        # The prompt's tokens, which decode counts alike whatever its block size; whole blocks
        # where vLLM's CPU attention packs pages in a way ferry does not map (its kernels other
        # than "vec": cpu_page_placement), which then needs one block size on both sides.
        key = transfer_key(tid, request.prompt_token_ids)
        blocks, tokens = list(block_ids[:need]), self._tokens(prompt)
        self._sending.add(req_id)
        if params.get(MODE, self._opts.mode) != "pull":
            self._meta.send.append(SendSpec(req_id, key, blocks, tokens))
            return True, {TRANSFER_ID: tid, "num_tokens": prompt}
        # Pull: the worker offers the blocks in the next step under a capability drawn here,
        # and decode builds its read parameters from prefill's handshake and these values (the
        # answer leaves before the worker can offer anything).
        cap = os.urandom(16)
        self._meta.offer.append(OfferSpec(req_id, key, blocks, tokens, cap))
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False, TRANSFER_ID: tid, MODE: "pull",
            "remote_host": self._opts.host, "remote_port": self._opts.port,
            REMOTE_TP: self._tp_size, REMOTE_BLOCKS: blocks, REMOTE_TOKENS: tokens,
            CAPABILITY: cap.hex(),
            # The offer's lease counts from the worker's offer_pull, a step after this.
            EXPIRES: time.time() + self._opts.lease, "num_tokens": prompt}

    def pending(self) -> bool:
        m = self._meta
        return bool(self._sending or m.send or m.offer or m.recv or m.fail_send or
                    m.cancel_recv or m.scheduled or m.preempted)


class _Worker:
    """The worker half: ferry's engine and connector over vLLM's KV tensors."""

    def __init__(self, opts: FerryOptions, vllm_config: "VllmConfig",
                 kv_cache_config: "KVCacheConfig"):
        import ferry

        self._opts = opts
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        try:
            from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                         get_tensor_model_parallel_world_size)
            self._tp_rank = get_tensor_model_parallel_rank()
            self._tp_size = get_tensor_model_parallel_world_size()
        except Exception:  # noqa: BLE001 - no TP group (a unit test): one rank
            self._tp_rank, self._tp_size = 0, 1
        self._engine = self._new_engine()
        self._conn = None
        self._server = None
        # Engines that lost a rail, with their connectors: polled until their transfers ended.
        self._retired: List[Tuple[Any, Any]] = []
        self._layout = None
        self._pool: List[torch.Tensor] = []
        self._lock = threading.Lock()
        self._recv: Dict[int, RecvSpec] = {}  # transfer id -> decode request
        self._send: Dict[int, str] = {}  # transfer id -> prefill req_id
        self._done_recv: Set[str] = set()
        self._failed_recv: Set[str] = set()
        self._done_send: Set[str] = set()
        # Events drawn from ferry while waiting for a preempted request's send to end, for the
        # next results().
        self._events: List[Any] = []
        # Side channel (host, port) -> the prefill rank's HandshakeInfo (address, pool, layout),
        # fetched once; dropped when a transfer from it fails (a restarted prefill has others).
        self._peers: Dict[Tuple[str, int], Any] = {}
        self._cancelled: Set[int] = set()  # transfer ids of aborted decode requests
        self._bytes_received = 0  # since the last take_stats
        self._layer_pos: Dict[str, int] = {}  # layer name -> its index in the registered layout
        self._layer_writes = 0  # since the last take_stats
        self._chunk_writes = 0  # since the last take_stats
        self._bytes_posted = 0  # ferry's bytes_posted at the last take_stats
        self._renewals = 0  # engines replaced after a lost rail since the last take_stats
        self._reopen = False  # a lost engine was retired; its replacement did not open yet
        # Fault injection for tests (python/tests/vllm/test_pd.py): while this file exists, the
        # next step deletes it and holds the engine's rail inside one call until the watchdog
        # declares it wedged, as libfabric's shm did on a lock nobody released. Unset: no check.
        self._wedge_file = os.environ.get("FERRY_VLLM_TEST_WEDGE_FILE") or None

    def register(self, kv_caches: Dict[str, torch.Tensor]):
        import ferry.kv as fkv

        names = sorted(kv_caches, key=_layer_index)
        tensors = [kv_caches[n] for n in names]
        # Layer-wise writes need the layer's KV written to memory when save_kv_layer is called:
        # so on CPU; a GPU forward is still queued on its stream then (whole requests there).
        if not tensors[0].is_cuda:
            self._layer_pos = {n: i for i, n in enumerate(names)}
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        num_blocks = self._kv_cache_config.num_blocks
        page = cpu_page_placement(tensors[0].dtype, spec.block_size, spec.head_size,
                                  self._vllm_config.cache_config.cache_dtype)
        layout, pool = layout_of(tensors, num_blocks=num_blocks, block_size=spec.block_size,
                                 num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                                 page_placement=page)
        self._layout, self._pool = layout, pool
        self._tensors = tensors
        self._open()
        logger.info("FerryConnector: %d layers registered as %s; side channel %s:%d (%s)",
                    len(tensors), layout, self._opts.host, self._opts.port + self._tp_rank,
                    self._opts.provider)

    def _new_engine(self):
        import ferry

        o = self._opts
        return ferry.TransferEngine(o.provider, op_timeout=o.op_timeout, rails=o.rails,
                                    rail_selection=o.rail_selection, cma_writes=o.cma_writes)

    def _open(self):
        """The connector over the KV tensors on self._engine, and the side channel that hands
        its address out."""
        import ferry.kv as fkv

        # Per-offer keys: each offer registers its blocks under keys of its own, closed when
        # it ends, and the host pool takes no peer reads. Decode, which builds its parameters
        # from the handshake (the scheduler answers before this worker offers), asks for the
        # live offer's keys when it pulls (KvConnector.pull, live_offer_wait).
        cfg = fkv.KvConfig(tp_rank=self._tp_rank, tp_size=self._tp_size, lease=self._opts.lease,
                           pull_keys="offer")
        self._conn = fkv.KvConnector(self._engine, self._layout, self._pool, cfg)
        port = self._opts.port + self._tp_rank
        self._server = fkv.HandshakeServer(self._conn, self._opts.secret, self._opts.host, port)

    def _renew_if_lost(self):
        """An engine whose rail wedged inside libfabric (TransferEngine.health) moves nothing
        more, for good: without a new one every later transfer of this worker would fail. The
        old connector ends its waiting transfers by itself (soon after the wedge, or at their
        leases where prefill may still write directly) and is polled until they all ended."""
        if self._conn is None:
            return
        if not self._reopen:
            why = self._engine.health
            if why is None:
                return
            logger.error("FerryConnector: ferry's transfer engine lost its rail (%s); opening a "
                         "new engine, connector and side channel", why)
            try:
                self._server.close()  # the side channel must hand out the new engine's address
            except Exception as e:  # noqa: BLE001 - the new one is what matters
                logger.warning("FerryConnector: closing the old side channel: %s", e)
            self._retired.append((self._engine, self._conn))
            self._reopen = True
        # Until a new one opens, self._conn is the retired connector: it refuses new transfers,
        # which vLLM then sees as failed loads.
        engine = None
        try:
            engine = self._new_engine()
            self._engine = engine
            self._open()
        except Exception as e:  # noqa: BLE001 - tried again next step
            logger.error("FerryConnector: opening a new engine failed (%s); trying again at the "
                         "next step", e)
            if engine is not None:
                engine.close()
            return
        self._reopen = False
        self._renewals += 1
        self._bytes_posted = 0  # the new connector counts from zero

    def _maybe_wedge(self):
        try:
            os.unlink(self._wedge_file)
        except OSError:
            return
        logger.warning("FerryConnector: FERRY_VLLM_TEST_WEDGE_FILE: wedging rail 0 of engine "
                       "%x for a test", self._engine.engine_id)
        engine = self._engine._engine
        threading.Thread(target=engine._wedge_rail_for_test, args=(0, 60.0), daemon=True,
                         name="ferry-test-wedge").start()

    def _drop_retired(self):
        """Closes retired connectors with no transfer left (their last events were polled)."""
        keep = []
        for engine, conn in self._retired:
            st = conn.stats()
            if st.get("active_send", 0) or st.get("active_recv", 0):
                keep.append((engine, conn))
                continue
            for obj in (conn, engine):
                try:
                    obj.close()
                except Exception as e:  # noqa: BLE001 - shutdown goes on
                    logger.warning("FerryConnector: closing a retired engine: %s", e)
        self._retired = keep

    def _digest(self, block_ids: List[int], num_tokens: int) -> str:
        """FERRY_VLLM_DEBUG=1: a sum per layer of the request's K and V, logged on both sides."""
        if not os.environ.get("FERRY_VLLM_DEBUG"):
            return ""
        out = []
        for t in self._tensors:
            pages = t[torch.tensor(block_ids, dtype=torch.long)]
            nb, h, n, c = pages.shape
            kv = pages.view(nb, h, 2, n, c // 2).permute(2, 0, 3, 1, 4).reshape(2, nb * n, h, -1)
            out.append(f"{float(kv[:, :num_tokens].float().abs().sum()):.3f}")
        return " digest " + "/".join(out)

    def _peer(self, host: str, port: int):
        import ferry.kv as fkv

        key = (host, port)
        if key not in self._peers:
            self._peers[key] = fkv.fetch_handshake(host, port, self._conn.layout,
                                                   self._opts.secret, timeout=5.0)
        return self._peers[key]

    def _ranks(self, spec: RecvSpec):
        ranks = [self._peer(spec.remote_host, spec.remote_port + r) for r in range(spec.remote_tp)]
        for r, info in enumerate(ranks):
            why = mismatch(info.layout, info.tp_rank, info.tp_size, self._conn.layout,
                           self._tp_size, r, spec.remote_tp)
            if why:
                import ferry

                raise ferry.InvalidArgument(
                    f"prefill {spec.remote_host}:{spec.remote_port + r} cannot send its KV "
                    f"here: {why}")
        return ranks

    def _fail_recv(self, spec: RecvSpec, why: str):
        logger.warning("FerryConnector: request %s (transfer %d): KV load failed: %s",
                       spec.req_id, spec.transfer_id, why)
        for r in range(max(spec.remote_tp, 0)):
            self._peers.pop((spec.remote_host, spec.remote_port + r), None)
        self._done_recv.add(spec.req_id)
        self._failed_recv.add(spec.req_id)

    def start(self, meta: FerryConnectorMetadata):
        import ferry

        if meta.started:  # bound twice (a draft model's forward): once is enough
            return
        meta.started = True
        self._renew_if_lost()
        if self._wedge_file is not None:
            self._maybe_wedge()
        conn = self._conn
        # Prefill requests this step computes: ferry renews their leases meanwhile.
        for req_id, tid in meta.scheduled:
            try:
                conn.prefill_scheduled(tid)
                if os.environ.get("FERRY_VLLM_DEBUG"):
                    logger.info("FerryConnector: computing %d (request %s)", tid, req_id)
            except ferry.Error as e:
                logger.warning("FerryConnector: request %s: prefill_scheduled: %s", req_id, e)
        for spec in meta.recv:
            if spec.remote_tp <= 0 or not spec.remote_host:
                self._fail_recv(spec, "kv_transfer_params lack remote_host / remote_port")
                continue
            try:
                if spec.remote_blocks is not None:
                    self._pull(spec)
                else:
                    ranks = [info.address for info in self._ranks(spec)]
                    conn.register_push(spec.transfer_id, spec.attempt, ranks, spec.block_ids,
                                       spec.num_tokens, first_token=spec.first_token)
                if os.environ.get("FERRY_VLLM_DEBUG"):
                    logger.info("FerryConnector: %s %d blocks %s tokens %d from %d (request %s)",
                                "pull" if spec.remote_blocks is not None else "register",
                                spec.transfer_id, spec.block_ids, spec.num_tokens,
                                spec.first_token, spec.req_id)
                self._recv[spec.transfer_id] = spec
            except ferry.Error as e:
                self._fail_recv(spec, str(e))
        for o in meta.offer:
            try:
                conn.offer_pull(o.transfer_id, o.block_ids, o.num_tokens,
                                capability=o.capability)
                self._send[o.transfer_id] = o.req_id
            except ferry.Error as e:
                logger.warning("FerryConnector: request %s: offer_pull refused: %s", o.req_id, e)
                self._done_send.add(o.req_id)
        for s in meta.send:
            try:
                conn.prefill_done(s.transfer_id, s.block_ids, s.num_tokens)
                if os.environ.get("FERRY_VLLM_DEBUG"):
                    logger.info("FerryConnector: send %d blocks %s tokens %d%s", s.transfer_id,
                                s.block_ids, s.num_tokens, self._digest(s.block_ids, s.num_tokens))
                self._send[s.transfer_id] = s.req_id
            except ferry.Error as e:
                logger.warning("FerryConnector: request %s: prefill_done refused: %s", s.req_id,
                               e)
                self._done_send.add(s.req_id)
        for req_id, tid, reason, hold in meta.fail_send:
            try:
                conn.prefill_failed(tid, reason)
                if hold:  # vLLM keeps its blocks until the send event: the writes ended
                    self._send[tid] = req_id
            except ferry.Error as e:
                logger.warning("FerryConnector: request %s: prefill_failed: %s", req_id, e)
                if hold:
                    self._done_send.add(req_id)
        for req_id, tid in meta.preempted:
            self._give_up_preempted(req_id, tid)
        for req_id, tid in meta.cancel_recv:
            if tid in self._recv:
                self._cancelled.add(tid)
                conn.cancel(tid)

    def _give_up_preempted(self, req_id: str, tid: int):
        """vLLM preempted a prefill request some of whose KV went out, and freed its blocks,
        which this step's forward may write for another request: fail the transfer (decode's
        load fails, by its kv_load_failure_policy) and wait, before the forward, until no
        write of it reads those blocks (its "send" event)."""
        import ferry

        logger.warning("FerryConnector: request %s: preempted while its KV was being sent; "
                       "its transfer fails (decode recomputes or fails by its "
                       "kv_load_failure_policy)", req_id)
        try:
            self._conn.prefill_failed(tid, "prefill preempted the request while sending its "
                                           "KV (its blocks were freed)")
        except ferry.Error as e:
            logger.warning("FerryConnector: request %s: prefill_failed: %s", req_id, e)
            return
        # Every write ends within op_timeout (completed, or failed by ferry's deadline).
        deadline = time.monotonic() + self._opts.op_timeout + 2.0
        while True:
            events = self._conn.poll()
            ended = any(ev.kind == "send" and ev.transfer_id == tid for ev in events)
            self._events.extend(ev for ev in events
                                if not (ev.kind == "send" and ev.transfer_id == tid))
            left = deadline - time.monotonic()
            if ended or left <= 0:
                break
            self._conn.wait(min(left, 0.05))
        if not ended:
            logger.error("FerryConnector: request %s: its writes did not end within %.0f s of "
                         "its preemption", req_id, self._opts.op_timeout + 2.0)

    def layer_computed(self, layer_name: str, specs: List[LayerSpec]):
        """The forward wrote `layer_name`'s KV: layers up to it go to the requests' decode
        ranks now (KvConnector.prefill_progress; registered ranks get them at once, later ones
        with the rest at prefill_done)."""
        import ferry

        pos = self._layer_pos.get(layer_name)
        if pos is None or self._conn is None:
            return
        # After the last layer the prompt's KV is whole: its tokens are ready in every layer
        # (a partial frontier must stay below the layer count), and prefill_done adds only
        # the end of the transfer.
        last = pos + 1 == len(self._layer_pos)
        for spec in specs:
            if not (last or spec.final):
                continue  # a chunk goes once its last layer is computed
            try:
                if last:
                    self._conn.prefill_progress(spec.transfer_id, spec.block_ids, spec.num_tokens)
                else:
                    self._conn.prefill_progress(spec.transfer_id, spec.block_ids,
                                                spec.first_token, partial_end=spec.num_tokens,
                                                partial_layers=pos + 1)
                if spec.final:
                    self._layer_writes += 1
                else:
                    self._chunk_writes += 1
            except ferry.Error as e:
                # The whole request is still written at request_finished.
                logger.warning("FerryConnector: request %s: layer %s not written early: %s",
                               spec.req_id, layer_name, e)

    def _pull(self, spec: RecvSpec):
        """Decode, pull: read prefill's offered blocks (on ferry's thread), if its offer still
        runs long enough for the reads to end within it. Prefill is asked for the live offer's
        own keys first (waiting until the offer's end for a worker that has not offered yet):
        an offer that ended, whose blocks may hold another request's KV, is refused
        (PROTOCOL.md, "Pull offer keys")."""
        import ferry
        import ferry.kv as fkv

        left = spec.expires - time.time()
        if left < self._opts.op_timeout:
            raise ferry.Unavailable(f"prefill's offer ends in {left:.1f} s, less than "
                                    f"op_timeout {self._opts.op_timeout:.1f} s: not read (raise "
                                    "prefill's lease)")
        params = [fkv.pull_params(info, spec.transfer_id, spec.remote_blocks, spec.num_tokens,
                                  spec.capability, left) for info in self._ranks(spec)]
        self._conn.pull(spec.transfer_id, params, spec.block_ids, spec.num_tokens,
                        first_token=spec.first_token, live_offer_wait=left)

    def results(self, wait: float = 0.0) -> KVConnectorTransferResults:
        """What ended since the last call. `wait` > 0: with transfers open and nothing ended,
        wait that long for ferry's next event first (a step that computes nothing)."""
        if self._conn is not None:
            events, self._events = self._events + self._conn.poll(), []
            if (wait > 0 and not events and (self._recv or self._send) and
                    not (self._done_send or self._done_recv) and not self._retired):
                if self._conn.wait(wait):
                    events = self._conn.poll()
            for _, old in self._retired:
                events.extend(old.poll())
            for ev in events:
                if ev.kind == "recv":
                    spec = self._recv.pop(ev.transfer_id, None)
                    if spec is None:
                        continue
                    if os.environ.get("FERRY_VLLM_DEBUG"):
                        logger.info("FerryConnector: recv %d ok %s blocks %s tokens %d%s",
                                    ev.transfer_id, ev.ok, spec.block_ids, spec.num_tokens,
                                    self._digest(spec.block_ids,
                                                 spec.num_tokens - spec.first_token))
                    if ev.ok:
                        self._bytes_received += ev.bytes
                    if ev.ok or ev.transfer_id in self._cancelled:
                        # A cancelled request is over: vLLM frees its blocks now.
                        self._cancelled.discard(ev.transfer_id)
                        self._done_recv.add(spec.req_id)
                    else:
                        self._fail_recv(spec, f"{ev.code}: {ev.message}")
                elif ev.kind == "send":
                    req_id = self._send.pop(ev.transfer_id, None)
                    if req_id is not None:
                        if not ev.ok:
                            logger.warning("FerryConnector: request %s: send ended: %s: %s",
                                           req_id, ev.code, ev.message)
                        self._done_send.add(req_id)
                elif ev.kind == "overflow":
                    logger.error("FerryConnector: %d ferry events were dropped", ev.dropped)
        if self._retired:
            self._drop_retired()
        r = KVConnectorTransferResults(finished_sending=self._done_send,
                                       finished_recving=self._done_recv,
                                       failed_recving=self._failed_recv)
        self._done_send, self._done_recv, self._failed_recv = set(), set(), set()
        return r

    def stats(self) -> Dict[str, int]:
        return dict(self._conn.stats()) if self._conn is not None else {}

    def take_stats(self) -> Optional[FerryStats]:
        """What moved since the last call (vLLM's get_kv_connector_stats, once a step)."""
        if self._conn is None:
            return None
        posted = int(self.stats().get("bytes_posted", 0))
        data = {"bytes_received": self._bytes_received,
                "bytes_posted": posted - self._bytes_posted, "layer_writes": self._layer_writes,
                "chunk_writes": self._chunk_writes, "engine_renewals": self._renewals}
        self._bytes_received, self._bytes_posted, self._layer_writes = 0, posted, 0
        self._chunk_writes = self._renewals = 0
        return FerryStats(data=data) if any(data.values()) else None

    def close(self):
        retired = [obj for pair in self._retired for obj in reversed(pair)]
        self._retired = []
        for obj in [self._server, self._conn, self._engine] + retired:
            try:
                if obj is not None:
                    obj.close()
            except Exception as e:  # noqa: BLE001 - shutdown goes on
                logger.warning("FerryConnector: close: %s", e)
        self._server = self._conn = None
