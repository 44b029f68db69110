"""ferry.kv: KV-cache transfer between prefill and decode engines (docs/PYTHON.md, "KV")."""

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Union

from . import TransferEngine
from ._ferry import HandshakeInfo as HandshakeInfo
from ._ferry import KvEvent as KvEvent
from ._ferry import KvLayout as KvLayout

Blocks = Any
"""Block ids in token order: a sequence of ints, or a one-dimensional integer numpy array /
torch tensor."""

TransferId = Union[int, str, bytes]
"""A transfer's id, the same on both sides: an int in [0, 2**64), or the engine's own request id
(a str, or bytes), whose 64-bit key is transfer_key(id). A name is kept by the connector while
the transfer is open on it (until its last event was polled): events carry it back as
KvEvent.request_id, and another name with the same 64-bit key is refused with InvalidArgument
meanwhile. Use names or ints on one connector, not both."""

def transfer_key(name: Union[str, bytes]) -> int:
    """The 64-bit id a str (UTF-8) or bytes transfer id travels as: FNV-1a of its bytes (the
    C++ library's ferry::kv::transfer_key, which ferry serve uses too). Stable across builds
    and hosts, so both sides of a transfer compute it alike; KvEvent.transfer_id is it."""

Pool = Any
"""The KV pool: one tensor (regions="one"), a list of one tensor per layer (regions=
"per-layer", vLLM's [2, num_blocks, block_size, heads, head_dim]), or a list of 2 * layers
tensors, K before V, or of (K, V) pairs per layer (regions="per-layer-kv", SGLang's buffers).
Torch tensors (CPU or CUDA) or numpy arrays; each contiguous, with elements of the layout's
elem_size, at least layout.region_bytes long."""

@dataclass
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
    pull_keys: str = "offer"
    max_events: int = 65536

class KvConnector:
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
    @property
    def layout(self) -> KvLayout:
        """The layout the connector was built with."""

    # Push, decode side
    def announce(self, transfer_id: TransferId, attempt: int, prefill_ranks: Sequence[bytes]) -> None:
        """Before holding blocks: ask the prefill ranks (their TransferEngine.address, in rank
        order) to say when they schedule the transfer; a "scheduled" event follows."""
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
    def cancel(self, transfer_id: TransferId) -> None:
        """Stop the transfer; its "recv" event (code "cancelled") comes once no write can land
        any more, and only then may the blocks be reused. An id this connector has no transfer
        for (never registered, or already over) is a no-op with no event: vLLM's abort path
        reports requests the connector never saw. It does not stop a later register_push of
        that id."""

    # Push, prefill side
    def prefill_scheduled(self, transfer_id: TransferId) -> None:
        """Prefill admitted the request: announced decode ranks may reserve their blocks."""
    def prefill_progress(self, transfer_id: TransferId, blocks: Blocks, tokens_ready: int, *,
                         partial_end: int = 0, partial_layers: int = 0) -> None:
        """Tokens [0, tokens_ready) are final (a chunk was computed), and [tokens_ready,
        partial_end) in layers [0, partial_layers): registered decode ranks get them now. Keep
        the blocks until the transfer's "send" event."""
    def prefill_done(self, transfer_id: TransferId, blocks: Blocks, num_tokens: int) -> None:
        """The KV is computed: write it to the decode ranks that registered (or will, within the
        lease). A "send" event says when the blocks are free."""
    def prefill_failed(self, transfer_id: TransferId, reason: str) -> None:
        """Prefill could not produce the KV: decode ranks get a failure carrying `reason`."""
    def abort_send(self, transfer_id: TransferId, reason: str) -> None:
        """Give up a transfer after prefill_done / offer_pull (its other leg failed); its
        "send" event (carrying `reason`) says when the blocks are free. An id with no transfer
        here (never offered, or already over) is a no-op with no event, as for cancel()."""

    # Pull
    def offer_pull(self, transfer_id: TransferId, blocks: Blocks, num_tokens: int, *,
                   capability: Optional[bytes] = None) -> bytes:
        """Prefill: hold the blocks under the lease; returns what decode's pull() needs (hand it
        over through the router). A "send" event comes when decode finished reading.
        capability: 16 random bytes the caller drew (default: ferry draws them), for a decode
        side that builds its parameters with pull_params(); only a DONE carrying them frees
        the blocks."""
    def pull(self, transfer_id: TransferId, params: Union[bytes, Sequence[bytes]],
             blocks: Blocks, num_tokens: int, *, first_token: int = 0) -> None:
        """Decode: read the KV from every prefill rank's offer_pull() bytes into `blocks`; a
        "recv" event ends it. first_token: only tokens [first_token, num_tokens) are read, and
        `blocks` start at that token's block (as for register_push)."""

    # Results
    def poll(self) -> List[KvEvent]:
        """Every event since the last poll, in the order ferry produced them; never blocks.
        Raises Cancelled once the connector is closed."""
    def wait(self, timeout: float) -> bool:
        """Block (GIL released) until an event is queued or `timeout` seconds passed; True when
        one is there. Raises Cancelled once the connector is closed (also a wait in progress,
        when close() is called on another thread); Ctrl-C raises KeyboardInterrupt within
        0.1 s."""
    def handshake_info(self) -> HandshakeInfo:
        """What this rank's HandshakeServer tells peers."""
    open_names: int
    """Transfer names (str or bytes ids) this connector keeps now: those of transfers whose
    last event was not polled yet."""
    def stats(self) -> dict:
        """Counters (ferry::kv::ConnectorStats): transfers_sent/received/failed, ops_posted,
        bytes_posted, leases_expired, active_send/active_recv (transfers holding blocks)."""
    def close(self) -> None:
        """Cancel what still runs, unregister the pool, release the tensors; every call
        afterwards (poll and wait too) raises Cancelled, a second close() does nothing."""
    def __enter__(self) -> KvConnector: ...
    def __exit__(self, *exc: Any) -> None: ...

class HandshakeServer:
    """The side channel of one connector: a small TCP service that tells peers proving the
    deployment secret (>= 16 bytes) this rank's engine address, pool and layout."""

    def __init__(self, connector: KvConnector, secret: bytes, host: str = "127.0.0.1",
                 port: int = 0, connection_deadline: float = 1.0) -> None:
        """connector: the KvConnector whose address, pool and layout are served. secret: the
        deployment secret (bytes, >= 16). host, port: where to listen (port 0: a free one, see
        .port). connection_deadline: seconds a peer may take to send its request."""
    port: int
    """The port listened on (a free one when 0 was asked)."""
    epoch: int
    """Random per server start: peers see a new value after a restart."""
    requests_served: int
    """Answers sent to peers that proved the secret."""
    auth_failures: int
    """Connections refused: a peer without the secret (or garbage)."""
    def close(self) -> None:
        """Stops serving and joins the server's thread; a second close() does nothing."""
    def __enter__(self) -> HandshakeServer: ...
    def __exit__(self, *exc: Any) -> None: ...

def pull_params(info: HandshakeInfo, transfer_id: TransferId, blocks: Blocks, num_tokens: int,
                capability: bytes, lease: float) -> bytes:
    """Decode: the bytes pull() takes, built from the prefill rank's HandshakeInfo (address,
    pool, layout, TP position) and what the request carried: the prefill rank's block ids,
    num_tokens, the 16-byte capability prefill offered them under (offer_pull(...,
    capability=)) and its lease in seconds. For engines whose prefill side answers the
    request before the process that holds the connector offers the blocks (vLLM)."""
def fetch_handshake(host: str, port: int, layout: KvLayout, secret: bytes,
                    timeout: float = 5.0) -> HandshakeInfo:
    """Ask a peer's HandshakeServer. Raises PermissionDenied when the secrets differ, an error
    naming both layouts when they are incompatible with `layout`, Unavailable or TimeoutError
    naming host:port when nobody answers."""
