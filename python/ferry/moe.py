"""Expert-parallel all-to-all over torch tensors: ferry's dispatch/combine from Python.

Two interfaces over one C++ all-to-all per rank (``ferry._ferry.MoeAllToAll``):

- :class:`AllToAll`, shaped after pplx-garden's ``P2PAllToAll``: caller-allocated outputs,
  split send/receive halves (``do_send`` / ``do_recv``), ``bound_m`` on the device.
- :class:`Buffer`, DeepEP's low-latency calls (``low_latency_dispatch`` /
  ``low_latency_combine``), with its shapes and dtypes and ``return_recv_hook``.

CPU tensors run on the CPU backend (ranks of a node through shared memory, other nodes through
a TransferEngine), CUDA tensors on the CUDA kernels, on the current torch stream. Ranks meet
through ``torch.distributed`` (any backend that can all-gather objects: gloo on CPU) or a
caller's ``allgather(bytes) -> list[bytes]``, used at setup only. See docs/PYTHON.md.

Tensors are read through their data pointers, so the extension links no libtorch (torch 1.13
and 2.x alike). On a torch without ``torch.float8_e4m3fn`` fp8 tensors are ``torch.uint8``
views holding the e4m3 bytes.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from . import _bool, _ferry
from ._ferry import Cancelled, InvalidArgument, InvalidType, Unavailable

_U32_MAX = 2**32 - 1  # the C++ all-to-all counts tokens, channels, experts and ranks in 32 bits

__all__ = ["AllToAll", "Buffer", "CombineHandle", "DispatchHandle", "EventOverlap", "fp8_dtype",
           "quantize_fp8", "dequantize_fp8"]

SCALE_BLOCK = 128
"""Channels per fp8 scale (include/ferry/moe/config.h kScaleBlock)."""

AllGather = Callable[[bytes], List[bytes]]
"""Setup exchange: every rank's blob, indexed by rank (collective)."""

_CPU = torch.device("cpu")
_FP8 = getattr(torch, "float8_e4m3fn", None)


def fp8_dtype() -> "torch.dtype":
    """The dtype fp8 tensors have here: torch.float8_e4m3fn, or torch.uint8 (the e4m3 bytes)
    on a torch that has no float8 dtypes (1.13)."""
    return _FP8 if _FP8 is not None else torch.uint8


def _is_fp8(dtype: Any) -> bool:
    return dtype == torch.uint8 or (_FP8 is not None and dtype == _FP8)


def _dispatch_kind(dtype: Any) -> str:
    """AllToAll's in_dtype: "bf16", "fp8" or "fp32" (fp32 rows travel as their bytes)."""
    if dtype == torch.float32:
        return "fp32"
    if dtype == torch.bfloat16:
        return "bf16"
    if _is_fp8(dtype):
        return "fp8"
    raise InvalidArgument(f"in_dtype must be torch.bfloat16, torch.float32 or fp8 e4m3 "
                          f"({fp8_dtype()}), got {dtype}")


def _dtype_text(dtypes: Sequence[Any]) -> str:
    return " or ".join(str(d) for d in dtypes)


def _check(name: str, t: Any, dtypes: Sequence[Any], shape: Sequence[Optional[int]],
           device: "torch.device") -> "torch.Tensor":
    """Refuses anything but a contiguous tensor of one of `dtypes`, `shape` (None: any size
    there) on `device`, naming the argument and what was expected."""
    if not isinstance(t, torch.Tensor):
        raise InvalidType(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise InvalidArgument(f"{name} must have dtype {_dtype_text(dtypes)}, got {t.dtype}")
    # "(*, 256)": a tuple of strings printed as "('*', 256)".
    want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + \
        ("," if len(shape) == 1 else "") + ")"
    if t.dim() != len(shape) or any(s is not None and s != g for s, g in zip(shape, t.shape)):
        raise InvalidArgument(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if t.device.type != device.type or (device.type == "cuda" and t.device.index != device.index):
        raise InvalidArgument(f"{name} must be on {device}, got a tensor on {t.device}")
    if not t.is_contiguous():
        raise InvalidArgument(f"{name} must be contiguous (shape {tuple(t.shape)}, stride "
                              f"{tuple(t.stride())}); pass {name}.contiguous()")
    return t


def _check_experts(indices: "torch.Tensor", num_experts: int) -> None:
    """CPU: every routing entry in [-1, num_experts) before int64 indices are narrowed to the
    int32 the CPU all-to-all reads (2**32 + 1 became expert 1, silently)."""
    bad = (indices < -1) | (indices >= num_experts)
    if indices.numel() and bool(bad.any()):
        t, j = (int(v) for v in bad.nonzero()[0])
        raise InvalidArgument(f"indices[{t}, {j}] is {int(indices[t, j])}; expert indices must "
                              f"be in [-1, {num_experts}) (-1: no expert)")


def _check_finite(name: str, w: "torch.Tensor") -> None:
    """CPU: the combine's weights, before its send half goes (the C++ check comes after it, and
    a refused receive half left the call not repeatable: "combine_send called out of order")."""
    if w.device.type != "cpu" or not w.numel():
        return
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        t, j = (int(v) for v in bad.nonzero()[0])
        raise InvalidArgument(f"{name}[{t}, {j}] is {float(w[t, j])}; combine weights must be "
                              "finite numbers")


def _check_min_rows(name: str, t: "torch.Tensor", need: int) -> None:
    if t.shape[1] < need:
        raise InvalidArgument(f"{name} must hold at least {need} rows per local expert "
                              f"(shape[1] >= {need}), got shape {tuple(t.shape)}")


def _indices(indices: Any) -> Any:
    """pplx-garden's uint32 routing (torch 2.3+) as the int32 it equals bit for bit (expert
    ids are far below 2^31)."""
    u32 = getattr(torch, "uint32", None)
    if u32 is not None and isinstance(indices, torch.Tensor) and indices.dtype == u32:
        return indices.view(torch.int32)
    return indices


def _check_flat_rows(name: str, t: "torch.Tensor", need: int) -> None:
    if int(t.shape[0]) < need:
        raise InvalidArgument(f"{name} has {int(t.shape[0])} rows; the flat layout (local "
                              f"experts' rows back to back) needs at least {need}")


def _unpack_slabs(counts: "torch.Tensor", pad: int, flat: bool,
                  pairs: Sequence[Tuple[Optional["torch.Tensor"], Optional["torch.Tensor"]]]
                  ) -> List[int]:
    """Copies each local expert's rows (its padding rows too, zeros in the slab) from the
    [experts, capacity, ...] slabs into the outputs: flat ones back to back, each expert's
    start padded to `pad`, or [experts, rows, ...] ones; of each slab row the outputs' first
    channels. Returns the start row of each expert in the flat layout and, last, the rows
    used."""
    starts, pos = [], 0
    for le, n in enumerate(counts.tolist()):
        starts.append(pos)
        rows = -(-int(n) // pad) * pad
        for slab, out in pairs:
            if slab is not None and rows:
                src = slab[le, :rows, :out.shape[-1]]
                if flat:
                    out[pos:pos + rows] = src
                else:
                    out[le, :rows] = src
        pos += rows
    starts.append(pos)
    return starts


def _pack_slab(e: "_Engine", flat_y: "torch.Tensor") -> "torch.Tensor":
    """A flat expert_y (rows laid out as the last flat dispatch put them) as the
    [experts, capacity, hidden] slab combine sends from."""
    slab, _ = e.slabs(flat_y.dtype, int(flat_y.shape[1]), 0, name="y")
    st = e.flat_starts
    for le in range(e.local_experts):
        rows = st[le + 1] - st[le]
        if rows:
            slab[le, :rows] = flat_y[st[le]:st[le + 1]]
    return slab


def _ptr(t: Optional["torch.Tensor"]) -> int:
    return 0 if t is None else int(t.data_ptr())


def _stream(device: "torch.device") -> int:
    if device.type != "cuda":
        return 0
    return int(torch.cuda.current_stream(device).cuda_stream)


def _allgather_of(group: Any) -> AllGather:
    import torch.distributed as dist

    def allgather(blob: bytes) -> List[bytes]:
        out: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, bytes(blob), group=group)
        return out

    return allgather


def _parallel_group(group: Any) -> bool:
    """pplx-garden's ParallelGroup (int ``rank`` and ``size``, ``all_gather_object``) rather
    than a torch.distributed group."""
    return (group is not None and isinstance(getattr(group, "rank", None), int)
            and isinstance(getattr(group, "size", None), int)
            and callable(getattr(group, "all_gather_object", None)))


def _group_size(group: Any) -> int:
    if _parallel_group(group):
        return int(group.size)
    import torch.distributed as dist

    return int(dist.get_world_size(group))


def _bootstrap(group: Any, rank: Optional[int], world_size: Optional[int],
               allgather: Optional[AllGather]
               ) -> Tuple[int, int, AllGather]:
    """rank, world size and the setup all-gather: the caller's, else torch.distributed's."""
    if allgather is not None:
        if rank is None or world_size is None:
            raise InvalidArgument("allgather given without rank and world_size: pass all three, "
                                  "or a torch.distributed group instead")
        if not callable(allgather):
            raise InvalidType("allgather must be a callable bytes -> list[bytes]")
        return int(rank), int(world_size), allgather
    if _parallel_group(group):
        g_rank, g_world = int(group.rank), int(group.size)
        if rank is not None and int(rank) != g_rank:
            raise InvalidArgument(f"rank {rank} differs from the group's rank {g_rank}")
        if world_size is not None and int(world_size) != g_world:
            raise InvalidArgument(f"world_size {world_size} differs from the group's size "
                                  f"{g_world}")
        return g_rank, g_world, lambda blob: [bytes(b) for b in
                                              group.all_gather_object(bytes(blob))]
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgument("no way for the ranks to meet: call torch.distributed."
                              "init_process_group first (gloo on CPU), or pass rank, world_size "
                              "and allgather")
    g_rank, g_world = dist.get_rank(group), dist.get_world_size(group)
    if rank is not None and int(rank) != g_rank:
        raise InvalidArgument(f"rank {rank} differs from torch.distributed's rank {g_rank}")
    if world_size is not None and int(world_size) != g_world:
        raise InvalidArgument(f"world_size {world_size} differs from the group's size {g_world}")
    return g_rank, g_world, _allgather_of(group)


def _integers(optional: bool = False, **values: Any) -> None:
    """Refuses, naming it, an argument that is not an int (optional: None means "not given")."""
    for name, v in values.items():
        if v is None and optional:
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise InvalidType(f"{name} must be an integer, got {type(v).__name__}")


def _device(device: Any) -> "torch.device":
    try:
        d = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as e:  # torch's own words for "gpu", None-like objects
        raise InvalidArgument(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}: "
                              f"{e}") from None
    if d.type not in ("cpu", "cuda"):
        raise InvalidArgument(f"device must be cpu or cuda, got {d}")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise Unavailable(f"device {d}: this torch sees no CUDA device "
                          "(torch.cuda.is_available() is False)")
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


class _Engine:
    """The C++ all-to-all of one rank plus the buffers it works in (all owned here, on the
    all-to-all's device, so the pointers handed to C++ stay valid)."""

    def __init__(self, *, max_tokens: int, hidden: int, kind: str, num_experts: int, topk: int,
                 rank: int, world: int, ranks_per_node: int, private_slots: int,
                 alignment: int, device: "torch.device", engine: Any, provider: str,
                 allgather: AllGather, timeout: float,
                 imm_offset: int = 0) -> None:
        # timeout: seconds AllToAll or Buffer checked (_ferry.seconds).
        _integers(max_num_tokens=max_tokens, hidden_dim=hidden, num_experts=num_experts,
                  num_experts_per_token=topk, rank=rank, world_size=world,
                  ranks_per_node=ranks_per_node, max_private_tokens=private_slots,
                  expert_padding=alignment)
        if engine is not None and not isinstance(getattr(engine, "_engine", None), _ferry.Engine):
            raise InvalidType(f"engine must be a ferry.TransferEngine, got "
                              f"{type(engine).__name__}")
        for name, v in (("max_num_tokens", max_tokens), ("hidden_dim", hidden),
                        ("num_experts", num_experts), ("num_experts_per_token", topk),
                        ("world_size", world), ("ranks_per_node", ranks_per_node)):
            if int(v) <= 0:
                raise InvalidArgument(f"{name} must be > 0, got {v}")
            if int(v) > _U32_MAX:
                raise InvalidArgument(f"{name} must be at most {_U32_MAX}, got {v}")
        for name, v in (("rank", rank), ("max_private_tokens", private_slots),
                        ("expert_padding", alignment)):
            if not 0 <= int(v) <= _U32_MAX:
                raise InvalidArgument(f"{name} must be in [0, {_U32_MAX}], got {v}")
        if kind == "fp8" and hidden % SCALE_BLOCK != 0:
            raise InvalidArgument(f"hidden_dim must be a multiple of {SCALE_BLOCK} for fp8 (one "
                                  f"scale per {SCALE_BLOCK} channels), got {hidden}")
        self.max_tokens, self.hidden, self.kind = int(max_tokens), int(hidden), kind
        self.alignment = int(alignment)
        self.flat_starts: Optional[List[int]] = None  # of the last dispatch into a flat layout
        self._slabs: dict = {}
        self.num_experts, self.topk, self.rank, self.world = num_experts, topk, rank, world
        self.device = device
        self.cuda = device.type == "cuda"
        self.allgather = allgather
        self.closed = True  # until the C++ all-to-all runs
        needs_engine = not self.cuda or ranks_per_node < world
        if engine is None and needs_engine:
            import ferry

            engine = ferry.TransferEngine(provider, same_host=True)
        self.engine = engine  # kept: the C++ all-to-all uses it until closed
        raw = None if engine is None else engine._engine
        self.a2a = _ferry.MoeAllToAll(
            max_tokens=self.max_tokens, hidden=self.hidden, dtype=kind,
            num_experts=int(num_experts), topk=int(topk), rank=int(rank), world=int(world),
            ranks_per_node=int(ranks_per_node), private_slots=int(private_slots),
            alignment=int(alignment), cuda=self.cuda,
            device=device.index if self.cuda else -1, engine=raw, allgather=allgather,
            timeout=timeout, imm_offset=int(imm_offset))
        self.closed = False
        self.local_experts = self.a2a.num_local_experts
        rows = self.a2a.max_expert_rows
        spt = hidden // SCALE_BLOCK if kind == "fp8" else 0
        self.spt = spt
        elem = 1 if kind == "fp8" else 2
        z = dict(device=device)
        self.offsets = torch.zeros(self.local_experts + 1, dtype=torch.int32, **z)
        if self.cuda:
            # Nothing is copied per call on the GPU: the kernels read the caller's routing
            # (int32 or int64) and weights, write and read the caller's [experts, capacity]
            # slabs, and take the token count from this table (entry t holds t) or bound_m.
            # Each copy or fill was a launch of its own, ~2-5 us apiece at the decode shape
            # (issue 16).
            self.token_counts = torch.arange(self.max_tokens + 1, dtype=torch.int32, **z)
            self.ones = torch.ones(self.max_tokens, topk, dtype=torch.float32, **z)
            self.num_tokens_dev = torch.zeros(1, dtype=torch.int32, **z)  # an int64 bound_m
        else:
            # The CPU backend works on its grouped batch and int32 routing.
            self.batch_x = torch.zeros(max(rows, 1) * hidden * elem, dtype=torch.uint8, **z)
            self.batch_scale = torch.zeros(max(rows * spt, 1), dtype=torch.float32, **z)
            self.batch_y = torch.zeros(max(rows, 1) * hidden, dtype=torch.bfloat16, **z)
            self.indices = torch.zeros(max_tokens, topk, dtype=torch.int32, **z)
            self.weights = torch.zeros(max_tokens, topk, dtype=torch.float32, **z)
        self.num_tokens = 0  # of the dispatch in flight (host count)
        self.rows = 0  # rows of its dp_x
        # Most rows one local expert can receive: every token of every rank, padded.
        self.capacity = -(-world * self.max_tokens // alignment) * alignment

    def send(self, x: "torch.Tensor", x_scale: Optional["torch.Tensor"],
             indices: "torch.Tensor", weights: Optional["torch.Tensor"], n: int,
             bound_m: Optional["torch.Tensor"]) -> None:
        t = x.shape[0]
        if self.cuda:
            if bound_m is None:
                count = _ptr(self.token_counts) + 4 * t
            elif bound_m.dtype == torch.int32:
                count = _ptr(bound_m)
            else:
                self.num_tokens_dev.copy_(bound_m.reshape(1))
                count = _ptr(self.num_tokens_dev)
            w = self.ones if weights is None else weights
            self.a2a.dispatch_send(n, count, _ptr(x), _ptr(x_scale), _ptr(indices),
                                   indices.dtype == torch.int64, _ptr(w), _stream(self.device))
            self._sent(n, t)
            return
        _check_experts(indices[:n], self.num_experts)
        self.indices[:t].copy_(indices)
        if weights is None:
            self.weights[:t].fill_(1.0)
        else:
            self.weights[:t].copy_(weights)
        self.a2a.dispatch_send(n, 0, _ptr(x), _ptr(x_scale), _ptr(self.indices), False,
                               _ptr(self.weights), 0)
        self._sent(n, t)

    def _sent(self, n: int, t: int) -> None:
        # Only once the call was taken: a refused second dispatch (out of order) left the count
        # of the first's combine changed to its own.
        self.num_tokens = n
        self.rows = t  # on CUDA the count is on the device: t bounds it

    def recv(self, counts: "torch.Tensor", out_x: "torch.Tensor",
             out_scale: Optional["torch.Tensor"]) -> None:
        staging = (0, 0) if self.cuda else (_ptr(self.batch_x), _ptr(self.batch_scale))
        self.a2a.dispatch_recv(staging[0], staging[1], _ptr(self.offsets), _ptr(counts),
                               _ptr(out_x), _ptr(out_scale), int(out_x.shape[1]),
                               _stream(self.device))

    def combine_send(self, expert_y: "torch.Tensor") -> None:
        self.a2a.combine_send(_ptr(expert_y), int(expert_y.shape[1]),
                              0 if self.cuda else _ptr(self.batch_y), _ptr(self.offsets),
                              _stream(self.device))

    def combine_recv(self, out: "torch.Tensor", weights: Optional["torch.Tensor"]) -> None:
        # weights: contiguous fp32 [T >= the dispatch's tokens, k], checked by the callers.
        self.a2a.combine_recv(self.num_tokens, _ptr(out), out.dtype == torch.bfloat16,
                              _ptr(weights), _stream(self.device))

    def buffer(self, name: str, shape: Tuple[int, ...], dtype: Any) -> "torch.Tensor":
        """A zeroed tensor on the all-to-all's device, made once per name, shape and dtype."""
        key = (name, tuple(shape), dtype)
        if key not in self._slabs:
            self._slabs[key] = torch.zeros(*shape, dtype=dtype, device=self.device)
        return self._slabs[key]

    def slabs(self, dtype: Any, hidden: int, spt: int, name: str = "x"
              ) -> Tuple["torch.Tensor", Optional["torch.Tensor"]]:
        """[experts, capacity, hidden] rows of dtype (and fp32 scales with spt > 0) that the
        flat layout and fp32 rows pass through."""
        shape = (self.local_experts, self.capacity)
        return (self.buffer(name, shape + (hidden,), dtype),
                self.buffer(name + "_scale", shape + (spt,), torch.float32) if spt else None)

    def check_open(self, what: str) -> None:
        if self.closed:
            raise Cancelled(f"{what} is closed (close() was called)")

    def close(self) -> None:
        # Collective, once: a second close() would wait in the all-gather for peers that
        # made theirs already (a hang under torch.distributed).
        if self.closed:
            return
        self.closed = True
        try:
            # No peer may still write into our buffers when they go.
            if self.cuda:
                self.a2a.synchronize(_stream(self.device))
            self.allgather(b"")
        finally:
            self.a2a.close()


class AllToAll:
    """One rank's expert-parallel all-to-all, shaped after pplx-garden's ``P2PAllToAll``.

    Collective constructor: every rank of the group builds one with the same arguments.
    Experts are split evenly over the ranks (rank r holds experts ``r * E/R .. (r + 1) * E/R -
    1``).

    max_num_tokens: most tokens a rank dispatches per call; num_experts: experts in all, split
    evenly over the ranks; num_experts_per_token: k of top-k; hidden_dim: channels per token,
    hidden_dim_scale: hidden_dim / 128 for fp8 (or None). in_dtype: the dispatch's dtype,
    torch.bfloat16, torch.float32 or fp8 (fp8_dtype()); out_dtype: the combine's (expert_y and
    out_tokens), torch.bfloat16 or torch.float32 (default: bf16 after fp8, else in_dtype), as in
    pplx-garden; scale_dtype torch.float32 (fp8 only, one scale per 128 channels);
    expert_padding pads each expert's received rows (zeros) to a multiple; max_private_tokens:
    rows per sender written before the counts are known (default min(max_num_tokens, 32)).
    device: "cpu" (CPU backend) or a CUDA device (kernels on the
    current stream). Ranks: torch.distributed (global_group, default WORLD; node_group's size
    gives ranks_per_node) or rank + world_size + allgather. dp_group of more than one rank is
    refused; pplx-garden's ParallelGroup (rank, size, all_gather_object) is taken for any
    group. engine (or pplx-garden's transfer_engine): a TransferEngine for other nodes (CPU:
    always needed; made with `provider` if not given). nets_per_gpu, imm_base, worker_cpu:
    accepted, unused (the engine picks its NICs). max_tokens_per_expert: rows of the
    [E_local, rows, H] outputs, at least max_recv_tokens. timeout: seconds every wait inside a
    call may take.
    """

    def __init__(self, max_num_tokens: int, num_experts: int, expert_padding: int,
                 hidden_dim: int, hidden_dim_scale: Optional[int] = None,
                 in_dtype: Any = torch.bfloat16, out_dtype: Any = None,
                 scale_dtype: Any = None, num_experts_per_token: int = 8,
                 max_private_tokens: Optional[int] = None, device: Any = None,
                 dp_group: Any = None, node_group: Any = None, global_group: Any = None,
                 nets_per_gpu: Optional[int] = None, imm_base: Optional[int] = None,
                 transfer_engine: Any = None, worker_cpu: Optional[int] = None,
                 max_tokens_per_expert: Optional[int] = None, *,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 ranks_per_node: Optional[int] = None,
                 allgather: Optional[AllGather] = None,
                 engine: Any = None, provider: str = "auto", timeout: float = 10.0) -> None:
        _integers(max_num_tokens=max_num_tokens, num_experts=num_experts,
                  expert_padding=expert_padding, hidden_dim=hidden_dim,
                  num_experts_per_token=num_experts_per_token)
        _integers(optional=True, hidden_dim_scale=hidden_dim_scale,
                  max_private_tokens=max_private_tokens, rank=rank, world_size=world_size,
                  ranks_per_node=ranks_per_node, nets_per_gpu=nets_per_gpu, imm_base=imm_base,
                  worker_cpu=worker_cpu, max_tokens_per_expert=max_tokens_per_expert)
        kind = _dispatch_kind(in_dtype)
        if out_dtype is None:
            out_dtype = torch.float32 if kind == "fp32" else torch.bfloat16
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise InvalidArgument(f"out_dtype is the combine's dtype (of expert_y and "
                                  f"out_tokens, as in pplx-garden): torch.bfloat16 or "
                                  f"torch.float32, got {out_dtype}")
        if kind == "fp8":
            if scale_dtype is not None and scale_dtype != torch.float32:
                raise InvalidArgument(f"scale_dtype must be torch.float32, got {scale_dtype}")
            if hidden_dim_scale is not None and int(hidden_dim_scale) != hidden_dim // SCALE_BLOCK:
                raise InvalidArgument(f"hidden_dim_scale must be hidden_dim / {SCALE_BLOCK} = "
                                      f"{hidden_dim // SCALE_BLOCK}, got {hidden_dim_scale}")
        elif hidden_dim_scale is not None or scale_dtype is not None:
            raise InvalidArgument(f"hidden_dim_scale / scale_dtype given with in_dtype "
                                  f"{in_dtype}: ferry dispatches scales with fp8 tokens only")
        if transfer_engine is not None:
            if engine is not None and engine is not transfer_engine:
                raise InvalidArgument("engine and transfer_engine are the same argument (ferry's "
                                      "name and pplx-garden's): pass one")
            engine = transfer_engine
        if dp_group is not None and _group_size(dp_group) != 1:
            raise InvalidArgument("dp_group of more than one rank (tokens shared within a "
                                  "data-parallel group) is not supported: pass None")
        if int(expert_padding) < 1:
            raise InvalidArgument(f"expert_padding must be >= 1, got {expert_padding}")
        rank, world, gather = _bootstrap(global_group, rank, world_size, allgather)
        if ranks_per_node is None:
            ranks_per_node = world if node_group is None else _group_size(node_group)
        if max_private_tokens is None:
            max_private_tokens = min(int(max_num_tokens), 32)
        pad = int(expert_padding)
        capacity = -(-world * int(max_num_tokens) // pad) * pad  # as _Engine.capacity
        if max_tokens_per_expert is not None and int(max_tokens_per_expert) < capacity:
            raise InvalidArgument(f"max_tokens_per_expert {max_tokens_per_expert} is below "
                                  f"{capacity}, the rows one local expert can receive "
                                  "(world size x max_num_tokens, padded to expert_padding)")
        self._dtype, self._out_dtype, self._kind = in_dtype, out_dtype, kind
        self._hidden = int(hidden_dim)
        # fp32 tokens travel as their bytes (twice as many bf16 channels), and an fp32 combine
        # row as three bf16 pieces (high part, middle, low) whose sum is the value exactly: the
        # all-to-all's rows are 3 x hidden bf16 channels, the dispatch using the first 2/3.
        self._wide = kind == "fp32"
        self._device = _device(device)
        self._engine_args = dict(
            max_tokens=max_num_tokens, hidden=hidden_dim * 3 if self._wide else hidden_dim,
            kind="fp8" if kind == "fp8" else "bf16", num_experts=num_experts,
            topk=num_experts_per_token, rank=rank, world=world,
            ranks_per_node=int(ranks_per_node), private_slots=int(max_private_tokens),
            alignment=int(expert_padding), device=self._device, provider=provider,
            allgather=gather, timeout=_ferry.seconds(timeout, "timeout"))
        self._e = _Engine(engine=engine, **self._engine_args)
        # dispatch_async may keep a second dispatch in flight (pplx-garden's dual-batch
        # overlap): each in-flight dispatch has a C++ all-to-all of its own, the second made
        # (collectively) the first time one is needed. _inflight: engines whose dispatch was
        # sent and not yet combined, oldest first (a plain combine takes the oldest).
        self._engines: List[_Engine] = [self._e]
        self._inflight: List[_Engine] = []

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        return self._e.rank

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self._e.world

    @property
    def num_local_experts(self) -> int:
        """Experts this rank holds (num_experts / world_size)."""
        return self._e.local_experts

    @property
    def max_recv_tokens(self) -> int:
        """Rows per local expert that out_expert_x (and expert_y) must hold at least."""
        return self._e.capacity

    def _dtypes(self) -> Tuple[Any, ...]:
        if self._kind == "fp8":
            return tuple(d for d in (_FP8, torch.uint8) if d is not None)
        return (torch.float32,) if self._kind == "fp32" else (torch.bfloat16,)

    def _tokens(self, name: str, t: int, bound_m: Optional["torch.Tensor"]) -> int:
        if t > self._e.max_tokens:
            raise InvalidArgument(f"{name} holds {t} tokens, more than max_num_tokens "
                                  f"{self._e.max_tokens}")
        if bound_m is None:
            return t
        _check("bound_m", bound_m, (torch.int32, torch.int64), (1,), self._device)
        if self._e.cuda:
            return t  # read by the kernels from the device; the host never waits for it
        m = int(bound_m.item())
        if not 0 <= m <= t:
            raise InvalidArgument(f"bound_m holds {m}; it must be in [0, {t}] ({name} rows)")
        return m

    def _bytes(self, t: "torch.Tensor") -> "torch.Tensor":
        """fp32 rows as the bf16 channels the all-to-all moves (same bytes, a view)."""
        return t.view(torch.bfloat16) if self._wide else t

    def dispatch(self, out_expert_num_tokens: "torch.Tensor", out_expert_x: "torch.Tensor",
                 out_expert_x_scale: Optional["torch.Tensor"], dp_x: "torch.Tensor",
                 dp_x_scale: Optional["torch.Tensor"], indices: "torch.Tensor",
                 weights: "torch.Tensor", bound_m: Optional["torch.Tensor"] = None,
                 do_send: bool = True, do_recv: bool = True) -> None:
        """Sends each token of ``dp_x`` ``[T, hidden]`` (in_dtype) to the ranks of its experts
        (``indices`` ``[T, k]`` int32/int64, -1 = no expert; ``weights`` ``[T, k]`` fp32, the
        combine weights unless combine passes others) and receives this rank's rows:
        ``out_expert_x[e, :n_e]`` (``[local experts, >= max_recv_tokens, hidden]``), their
        scales in ``out_expert_x_scale`` (fp8), ``n_e`` in ``out_expert_num_tokens`` (int32).
        Rows past ``n_e`` (padding to ``expert_padding`` aside, which is zeros) are left as
        they were. ``bound_m``: a one-element tensor on the device holding the token count
        (at most T). ``do_send`` / ``do_recv`` split the call into its halves, in that order.

        ``out_expert_x`` may also be pplx-garden's flat layout, ``[rows, hidden]`` (its scales
        ``[rows, hidden / 128]``): the local experts' rows back to back, expert ``e`` from row
        ``sum over e' < e of round_up(n_e', expert_padding)``; ``rows`` at least
        :attr:`max_recv_tokens_flat`. The rows arrive in ferry's per-expert slabs and are
        copied there (on CUDA the host reads the counts: one synchronisation)."""
        self._e.check_open("ferry.moe.AllToAll")
        self._dispatch(self._e, out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x,
                       dp_x_scale, indices, weights, bound_m, do_send, do_recv)

    def _dispatch(self, e: "_Engine", out_expert_num_tokens: Any, out_expert_x: Any,
                  out_expert_x_scale: Any, dp_x: Any, dp_x_scale: Any, indices: Any,
                  weights: Any, bound_m: Any, do_send: Any, do_recv: Any) -> None:
        dev = self._device
        do_send, do_recv = _bool("do_send", do_send), _bool("do_recv", do_recv)
        h, k, spt, nl = self._hidden, e.topk, e.spt, e.local_experts
        # Every argument of both halves is checked before anything is sent, so a mistake
        # leaves no call half done.
        if do_send:
            _check("dp_x", dp_x, self._dtypes(), (None, h), dev)
            t = int(dp_x.shape[0])
            n = self._tokens("dp_x", t, bound_m)
            if e.kind == "fp8":
                _check("dp_x_scale", dp_x_scale, (torch.float32,), (t, spt), dev)
            indices = _indices(indices)
            _check("indices", indices, (torch.int32, torch.int64), (t, k), dev)
            _check("weights", weights, (torch.float32,), (t, k), dev)
        scale = None
        flat = isinstance(out_expert_x, torch.Tensor) and out_expert_x.dim() == 2
        if do_recv:
            _check("out_expert_num_tokens", out_expert_num_tokens, (torch.int32,), (nl,), dev)
            if flat:
                _check("out_expert_x", out_expert_x, self._dtypes(), (None, h), dev)
                _check_flat_rows("out_expert_x", out_expert_x, self.max_recv_tokens_flat)
                if e.kind == "fp8":
                    scale = _check("out_expert_x_scale", out_expert_x_scale, (torch.float32,),
                                   (out_expert_x.shape[0], spt), dev)
            else:
                _check("out_expert_x", out_expert_x, self._dtypes(), (nl, None, h), dev)
                _check_min_rows("out_expert_x", out_expert_x, e.capacity)
                if e.kind == "fp8":
                    scale = _check("out_expert_x_scale", out_expert_x_scale, (torch.float32,),
                                   (nl, out_expert_x.shape[1], spt), dev)
        if do_send:
            x = self._bytes(dp_x)
            if self._wide:  # into the first 2/3 of the all-to-all's rows
                staged = e.buffer("dp_x", (e.max_tokens, e.hidden), torch.bfloat16)[:t]
                staged[:, :x.shape[1]] = x
                x = staged
            e.send(x, dp_x_scale if e.kind == "fp8" else None, indices, weights, n, bound_m)
            self._inflight.append(e)
        if do_recv:
            if not flat and not self._wide:
                e.flat_starts = None
                e.recv(out_expert_num_tokens, out_expert_x, scale)
                return
            # Through ferry's [experts, capacity, row] slabs: into a flat layout, or the first
            # 2/3 of fp32 rows' channels into out_expert_x.
            slab, slab_scale = e.slabs(torch.bfloat16 if self._wide else out_expert_x.dtype,
                                       e.hidden, spt if scale is not None else 0)
            e.recv(out_expert_num_tokens, slab, slab_scale)
            starts = _unpack_slabs(out_expert_num_tokens, e.alignment, flat,
                                   [(slab, self._bytes(out_expert_x)), (slab_scale, scale)])
            e.flat_starts = starts if flat else None

    def _combine_rows(self, expert_y: "torch.Tensor") -> "torch.Tensor":
        """expert_y as the bf16 rows combine carries: fp32 rounded to bf16; after an fp32
        dispatch, three pieces per value in the three-times-wide rows: hi = bf16(y),
        mid = bf16(y - hi), lo = y - hi - mid (exact in bf16: what is left of fp32's 24
        significant bits after 16), so hi + mid + lo == y for every normal fp32 value whose
        low piece is not below bf16's subnormals (|y| above about 1e-33)."""
        if not self._wide:
            return expert_y if expert_y.dtype == torch.bfloat16 else expert_y.to(torch.bfloat16)
        # Pieces made contiguous and joined once: converting into strided slices of the rows
        # took 12 ms a call at 8 x 64 rows of 1024 on the 2-core CPU machine, against 1.6 ms.
        hi = expert_y.to(torch.bfloat16)
        if expert_y.dtype == torch.float32:
            rest = expert_y - hi.float()
            mid = rest.to(torch.bfloat16)
            lo = (rest - mid.float()).to(torch.bfloat16)
        else:
            mid = lo = torch.zeros_like(hi)
        return torch.cat([hi, mid, lo], dim=-1)

    def combine(self, out_tokens: "torch.Tensor", indices: "torch.Tensor",
                weights: "torch.Tensor", expert_y: "torch.Tensor",
                bound_m: Optional["torch.Tensor"] = None, do_send: bool = True,
                do_recv: bool = True, accumulate: bool = False) -> None:
        """Sends the expert outputs ``expert_y`` (``[local experts, >= max_recv_tokens,
        hidden]``, out_dtype: bf16 or fp32, laid out like ``out_expert_x``) back and writes
        ``out_tokens[t] = sum_k weights[t, k] * expert_y(t, k)`` (bf16 or fp32 ``[T, hidden]``,
        summed in fp32 in top-k order; ``accumulate=True`` adds it to ``out_tokens``). The
        routing is the last dispatch's: ``indices`` is checked for shape only; ``bound_m`` as in
        dispatch (the count given there is used). After a dispatch into the flat layout,
        ``expert_y`` may be flat too (``[rows, hidden]``, the same rows). With two dispatches
        in flight (:meth:`dispatch_async`), combine answers the older one."""
        self._e.check_open("ferry.moe.AllToAll")
        e = self._inflight[0] if self._inflight else self._e
        self._combine(e, out_tokens, indices, weights, expert_y, do_send, do_recv, accumulate)

    def _combine(self, e: "_Engine", out_tokens: Any, indices: Any, weights: Any,
                 expert_y: Any, do_send: Any, do_recv: Any, accumulate: Any) -> None:
        dev = self._device
        do_send, do_recv = _bool("do_send", do_send), _bool("do_recv", do_recv)
        accumulate = _bool("accumulate", accumulate)
        h = self._hidden
        if do_send:
            if isinstance(expert_y, torch.Tensor) and expert_y.dim() == 2:
                _check("expert_y", expert_y, (torch.bfloat16, torch.float32), (None, h), dev)
                if e.flat_starts is None:
                    raise InvalidArgument(
                        f"expert_y of shape {tuple(expert_y.shape)} is pplx-garden's flat "
                        "layout, but the dispatch received into per-expert slabs "
                        f"[{e.local_experts}, rows, {h}]: lay expert_y out like out_expert_x")
                _check_flat_rows("expert_y", expert_y, e.flat_starts[-1])
                expert_y = _pack_slab(e, expert_y)
            _check("expert_y", expert_y, (torch.bfloat16, torch.float32),
                   (e.local_experts, None, h), dev)
            _check_min_rows("expert_y", expert_y, e.capacity)
        if do_recv:
            _check("out_tokens", out_tokens, (torch.bfloat16, torch.float32), (None, h), dev)
            t = int(out_tokens.shape[0])
            if t > e.max_tokens:
                raise InvalidArgument(f"out_tokens holds {t} tokens, more than max_num_tokens "
                                      f"{e.max_tokens}")
            need = e.rows if e.cuda else e.num_tokens
            if t < need:
                raise InvalidArgument(f"out_tokens holds {t} rows; the dispatch sent "
                                      f"{need} tokens")
            for name, v in (("indices", indices), ("weights", weights)):
                # One row per token of out_tokens: named as such, not as a wrong shape of v
                # derived from out_tokens ("indices must have shape (6, 2)" for 6 output rows).
                rows = getattr(v, "shape", (t,))[:1]
                if len(rows) == 1 and int(rows[0]) != t:
                    raise InvalidArgument(f"{name} has {int(rows[0])} rows but out_tokens has {t}: "
                                          "combine takes one row of each per token")
            _check("indices", _indices(indices), (torch.int32, torch.int64), (t, e.topk), dev)
            _check("weights", weights, (torch.float32,), (t, e.topk), dev)
            _check_finite("weights", weights[:need])
        if do_send:
            e.combine_send(self._combine_rows(expert_y))
        if do_recv:
            if e in self._inflight:
                self._inflight.remove(e)
            if not self._wide and not accumulate:
                e.combine_recv(out_tokens, weights)
                return
            # Rows the combine writes: the dispatch's count (CUDA: at most t, on the device).
            n = t if e.cuda else e.num_tokens
            if self._wide:
                # each piece summed in fp32 over the token's experts, in top-k order; the
                # small ones first
                acc = torch.zeros(t, 3 * h, dtype=torch.float32, device=dev)
                e.combine_recv(acc, weights)
                got = acc[:n, :h] + (acc[:n, h:2 * h] + acc[:n, 2 * h:])
            else:
                got = torch.zeros(t, h, dtype=out_tokens.dtype, device=dev)
                e.combine_recv(got, weights)
                got = got[:n]
            if accumulate:
                out_tokens[:n] += got.to(out_tokens.dtype)
            else:
                out_tokens[:n] = got

    def synchronize(self) -> None:
        """CUDA: waits for the current stream and raises a device-side error (a peer that
        timed out, a bad routing entry) as ferry.Error. CPU: nothing to wait for."""
        self._e.check_open("ferry.moe.AllToAll")
        self._e.a2a.synchronize(_stream(self._device))

    @property
    def max_recv_tokens_flat(self) -> int:
        """Rows a flat ``out_expert_x`` (pplx-garden's ``[rows, hidden]``) must hold at least:
        every token of every rank to up to ``num_experts_per_token`` local experts, each
        expert's rows padded to ``expert_padding``."""
        e = self._e
        tokens, pad, nl = e.world * e.max_tokens, e.alignment, e.local_experts
        rows = min(tokens * min(e.topk, nl) + nl * (pad - 1), nl * (-(-tokens // pad) * pad))
        return -(-rows // pad) * pad

    def dispatch_async(self, *, out_expert_num_tokens: "torch.Tensor",
                       out_expert_x: "torch.Tensor", out_expert_x_scale: Optional["torch.Tensor"],
                       dp_x: "torch.Tensor", dp_x_scale: Optional["torch.Tensor"],
                       indices: "torch.Tensor", weights: "torch.Tensor",
                       bound_m: Optional["torch.Tensor"] = None) -> "DispatchHandle":
        """pplx-garden's dispatch_async: the send half of dispatch() now (same arguments:
        out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale, indices,
        weights, bound_m); the returned handle's recv() receives. Two dispatches may be in
        flight (dual-batch overlap); the second uses a C++ all-to-all of its own, made
        collectively on first use. A third raises InvalidArgument."""
        self._e.check_open("ferry.moe.AllToAll")
        idle = [e for e in self._engines if e not in self._inflight]
        if idle:
            e = idle[0]
        elif len(self._engines) >= _MAX_IN_FLIGHT:
            raise InvalidArgument(f"{len(self._inflight)} dispatches are in flight, the most "
                                  "ferry keeps: combine one first")
        else:
            # On the same TransferEngine, with immediates of its own.
            e = _Engine(engine=self._e.engine, imm_offset=_IMM_STRIDE * len(self._engines),
                        **self._engine_args)
            self._engines.append(e)
        self._dispatch(e, out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x,
                       dp_x_scale, indices, weights, bound_m, True, False)
        return DispatchHandle(self, e, out_expert_num_tokens, out_expert_x, out_expert_x_scale,
                              dp_x, dp_x_scale, indices, weights, bound_m, _event(self._device))

    def combine_async(self, *, out_tokens: "torch.Tensor", dispatch_handle: "DispatchHandle",
                      expert_y: "torch.Tensor", bound_m: Optional["torch.Tensor"] = None,
                      accumulate: bool = False) -> "CombineHandle":
        """pplx-garden's combine_async: the send half of combine() for the dispatch behind
        dispatch_handle (received first; its indices and weights are used) with expert_y;
        the returned handle's recv() writes out_tokens (added with accumulate). bound_m as in
        combine()."""
        self._e.check_open("ferry.moe.AllToAll")
        h = dispatch_handle
        if not isinstance(h, DispatchHandle) or h.kernel is not self:
            raise InvalidType("dispatch_handle must be what this AllToAll's dispatch_async "
                              "returned")
        if not h.recv_done:
            raise InvalidArgument("dispatch_handle.recv() was not called: combine answers a "
                                  "dispatch that was received")
        if h.engine not in self._inflight:
            raise InvalidArgument("this dispatch was combined already")
        self._combine(h.engine, out_tokens, h.indices, h.weights, expert_y, True, False,
                      accumulate)
        return CombineHandle(self, h, out_tokens, expert_y, bound_m, bool(accumulate),
                             _event(self._device))

    def close(self) -> None:
        """Collective: every rank calls it after its last combine. Later calls raise
        ferry.Cancelled; a second close() does nothing."""
        for e in self._engines:
            e.close()

    def destroy(self) -> None:  # pplx-garden's name
        """pplx-garden's name for close()."""
        self.close()

    def __enter__(self) -> "AllToAll":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_MAX_IN_FLIGHT = 2  # dispatches AllToAll keeps in flight (dispatch_async), each its own engine
# Between the immediates of the C++ all-to-alls of one AllToAll (they share its engine): more
# than either backend's range (include/ferry/moe/all_to_all.h, cuda_all_to_all.h).
_IMM_STRIDE = 0x100000


def _event(device: "torch.device") -> Any:
    """A CUDA event recorded on the current stream after a send half (pplx-garden's
    send_done_event); None on the CPU, where the half is done when the call returns."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


class _Handle:
    """pplx-garden's handles: recv() runs the receive half once (CUDA: on the current stream,
    after the send half's event); again, it does nothing."""

    kernel: AllToAll
    send_done_event: Any
    recv_done: bool

    def recv(self) -> None:
        """The receive half: DispatchHandle's fills the dispatch's outputs, CombineHandle's
        writes out_tokens (CUDA: after the send's event, on the current stream); once, a second
        call does nothing."""
        if self.recv_done:
            return
        self.kernel._e.check_open("ferry.moe.AllToAll")
        if self.send_done_event is not None:
            torch.cuda.current_stream(self.kernel._device).wait_event(self.send_done_event)
        self._receive()
        self.recv_done = True

    def _receive(self) -> None:
        raise NotImplementedError


class DispatchHandle(_Handle):
    """What :meth:`AllToAll.dispatch_async` returns (pplx-garden's ``P2PDispatchHandle``):
    ``recv()`` receives into the outputs given to dispatch_async (once; again does nothing).
    Made by dispatch_async, not by callers: ``kernel`` (the AllToAll), ``engine`` (its C++
    all-to-all for this dispatch), the call's ``out_expert_num_tokens``, ``out_expert_x``,
    ``out_expert_x_scale``, ``dp_x``, ``dp_x_scale``, ``indices``, ``weights``, ``bound_m``
    (kept as attributes, as pplx-garden's handle keeps them) and ``send_done_event`` (CUDA:
    recorded after the send half; None on the CPU)."""

    def __init__(self, kernel: AllToAll, engine: _Engine, out_expert_num_tokens: Any,
                 out_expert_x: Any, out_expert_x_scale: Any, dp_x: Any, dp_x_scale: Any,
                 indices: Any, weights: Any, bound_m: Any, send_done_event: Any) -> None:
        self.kernel, self.engine = kernel, engine
        self.out_expert_num_tokens, self.out_expert_x = out_expert_num_tokens, out_expert_x
        self.out_expert_x_scale, self.dp_x, self.dp_x_scale = out_expert_x_scale, dp_x, dp_x_scale
        self.indices, self.weights, self.bound_m = indices, weights, bound_m
        self.send_done_event = send_done_event
        self.recv_done = False

    def _receive(self) -> None:
        self.kernel._dispatch(self.engine, self.out_expert_num_tokens, self.out_expert_x,
                              self.out_expert_x_scale, None, None, None, None, None, False, True)


class CombineHandle(_Handle):
    """What :meth:`AllToAll.combine_async` returns (pplx-garden's ``P2PCombineHandle``):
    ``recv()`` writes ``out_tokens`` (once; again does nothing). Made by combine_async:
    ``kernel``, ``dispatch_handle`` (whose routing and weights combine uses), the call's
    ``out_tokens``, ``expert_y``, ``bound_m``, ``accumulate``, and ``send_done_event`` as in
    DispatchHandle."""

    def __init__(self, kernel: AllToAll, dispatch_handle: DispatchHandle, out_tokens: Any,
                 expert_y: Any, bound_m: Any, accumulate: bool, send_done_event: Any) -> None:
        self.kernel, self.dispatch_handle, self.out_tokens = kernel, dispatch_handle, out_tokens
        self.expert_y, self.bound_m, self.accumulate = expert_y, bound_m, accumulate
        self.send_done_event = send_done_event
        self.recv_done = False

    def _receive(self) -> None:
        d = self.dispatch_handle
        self.kernel._combine(d.engine, self.out_tokens, d.indices, d.weights, None, False, True,
                             self.accumulate)


class EventOverlap:
    """DeepEP's event type, for code that calls it: ferry's calls run on the current stream
    (CUDA) or complete before returning (CPU), so there is nothing to wait for."""

    def __init__(self, event: Any = None) -> None:
        self.event = event

    def current_stream_wait(self) -> None:
        """Returns: nothing to wait for."""
        pass

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _Handle:
    """What low_latency_combine needs from its dispatch (DeepEP's handle is a tuple; this one
    is opaque)."""

    def __init__(self, engine: _Engine, num_tokens: int, key: Tuple[Any, ...]) -> None:
        self.engine, self.num_tokens, self.key = engine, num_tokens, key


def _refuse(name: str, value: Any, default: Any, why: str) -> None:
    if value is not default and value != default:
        raise InvalidArgument(f"{name}={value!r} is not supported by ferry.moe.Buffer: {why}")


def _refuse_others(call: str, extra: dict) -> None:
    """Arguments of newer DeepEP versions (use_nvfp4, x_global_scale, ...) that ferry does not
    know: refused by name instead of a TypeError."""
    if extra:
        names = ", ".join(sorted(extra))
        raise InvalidArgument(f"{call}: argument(s) {names} not supported by ferry.moe.Buffer")


def _noop() -> None:
    pass


_NORMAL_MODE = ("is DeepEP's normal (high-throughput) mode, which ferry.moe.Buffer does not "
                "implement: use low_latency_dispatch / low_latency_combine on a "
                "Buffer(..., low_latency_mode=True)")


class Buffer:
    """DeepEP's ``deep_ep.Buffer`` in low-latency mode, on ferry's all-to-all.

    As in DeepEP, ``low_latency_mode`` defaults to False and the low-latency calls need it
    True; normal-mode calls (``dispatch``, ``combine``, ``get_dispatch_layout``) raise
    ferry.InvalidArgument. ``num_nvl_bytes`` / ``num_rdma_bytes`` / ``num_qps_per_rank`` are
    kept as attributes and otherwise ignored (ferry sizes its buffers from the first call's
    shape). One all-to-all is built per (max tokens, experts, hidden, top-k, fp8) at the first
    call with that shape (a collective: all ranks make the same calls, as DeepEP requires).
    Per shape, calls go dispatch -> (hook) -> combine -> (hook): one micro-batch at a time.
    """

    def __init__(self, group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, *,
                 rank: Optional[int] = None,
                 world_size: Optional[int] = None, ranks_per_node: Optional[int] = None,
                 allgather: Optional[AllGather] = None,
                 engine: Any = None, provider: str = "auto", device: Any = None,
                 private_slots: Optional[int] = None, timeout: float = 10.0,
                 **unsupported: Any) -> None:
        """group: the torch.distributed group the ranks meet through (default WORLD), or
        rank + world_size + allgather (a callable bytes -> list[bytes], one per rank) instead.
        low_latency_mode: False by default (DeepEP's), True for the low-latency calls;
        enable_shrink=True is refused; num_nvl_bytes, num_rdma_bytes, num_qps_per_rank,
        allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy: unused.
        ranks_per_node: ranks that share memory (default all); the others are reached through
        engine (a ferry.TransferEngine; made with provider when not given). device: where the
        all-to-alls run (default: each call's x.device). private_slots: rows per sender written
        before the counts are known (default min(tokens, 32)). timeout: seconds any wait inside
        a call may take. Any other keyword (a newer DeepEP's) is refused by name
        (ferry.InvalidArgument)."""
        _refuse_others("Buffer", unsupported)
        # allow_mnnvl and allow_nvlink_for_low_latency_mode permit a path, they do not ask for
        # one: ferry picks shared memory or its engine by ranks_per_node.
        _refuse("enable_shrink", enable_shrink, False, "ranks cannot be dropped from a Buffer")
        self.low_latency_mode = _bool("low_latency_mode", low_latency_mode)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = bool(explicitly_destroy)
        self.group = group
        _integers(optional=True, rank=rank, world_size=world_size, ranks_per_node=ranks_per_node,
                  private_slots=private_slots)
        timeout = _ferry.seconds(timeout, "timeout")
        self.rank, self.group_size, self._gather = _bootstrap(group, rank, world_size, allgather)
        self._rpn = int(ranks_per_node) if ranks_per_node is not None else self.group_size
        self._engine, self._provider, self._timeout = engine, provider, timeout
        self._device = None if device is None else _device(device)
        self._private = private_slots
        self._a2a: dict = {}
        self._closed = False

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """DeepEP's sizing call: bytes of the buffers one rank of a low-latency Buffer holds
        for calls of this shape (bf16 rows, any top-k up to 64), to pass as
        ``num_rdma_bytes``. ferry sizes its buffers itself from the first call, so the number
        is for code that sizes or compares Buffers by it."""
        _integers(num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                  hidden=hidden, num_ranks=num_ranks, num_experts=num_experts)
        for name, v in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                        ("hidden", hidden), ("num_ranks", num_ranks),
                        ("num_experts", num_experts)):
            if not 0 < int(v) <= _U32_MAX:
                raise InvalidArgument(f"{name} must be in [1, {_U32_MAX}], got {v}")
        if num_experts % num_ranks != 0:
            raise InvalidArgument(f"num_experts {num_experts} must be a multiple of num_ranks "
                                  f"{num_ranks}")
        t = int(num_max_dispatch_tokens_per_rank)
        return int(_ferry.moe_rank_bytes(t, int(hidden), int(num_experts),
                                         min(int(num_experts), 64), int(num_ranks), min(t, 32)))

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        """DeepEP's normal-mode dispatch: not implemented (raises ferry.InvalidArgument)."""
        raise InvalidArgument(f"Buffer.dispatch {_NORMAL_MODE}")

    def combine(self, *args: Any, **kwargs: Any) -> Any:
        """DeepEP's normal-mode combine: not implemented (raises ferry.InvalidArgument)."""
        raise InvalidArgument(f"Buffer.combine {_NORMAL_MODE}")

    def get_dispatch_layout(self, *args: Any, **kwargs: Any) -> Any:
        """DeepEP's normal-mode layout: not implemented (raises ferry.InvalidArgument)."""
        raise InvalidArgument(f"Buffer.get_dispatch_layout {_NORMAL_MODE}")

    @staticmethod
    def get_dispatch_config(*args: Any, **kwargs: Any) -> Any:
        """DeepEP's normal-mode config: not implemented (raises ferry.InvalidArgument)."""
        raise InvalidArgument(f"Buffer.get_dispatch_config {_NORMAL_MODE}")

    @staticmethod
    def get_combine_config(*args: Any, **kwargs: Any) -> Any:
        """DeepEP's normal-mode config: not implemented (raises ferry.InvalidArgument)."""
        raise InvalidArgument(f"Buffer.get_combine_config {_NORMAL_MODE}")

    def _get(self, x: "torch.Tensor", k: int, max_tokens: int, num_experts: int,
             fp8: bool) -> Tuple[_Engine, Tuple[Any, ...]]:
        dev = x.device if self._device is None else self._device
        key = (int(max_tokens), int(num_experts), int(x.shape[1]), int(k), bool(fp8), str(dev))
        a = self._a2a.get(key)
        if a is None and self._a2a and self._engine is not None:
            raise InvalidArgument(
                "a second call shape on a Buffer given an engine: each all-to-all needs an "
                "engine of its own (their immediates would collide); pass no engine, or one "
                "Buffer per shape")
        if a is None:
            if num_experts % self.group_size != 0:
                raise InvalidArgument(f"num_experts {num_experts} must be a multiple of the "
                                      f"group size {self.group_size}")
            a = _Engine(max_tokens=int(max_tokens), hidden=int(x.shape[1]),
                        kind="fp8" if fp8 else "bf16", num_experts=int(num_experts), topk=k,
                        rank=self.rank, world=self.group_size, ranks_per_node=self._rpn,
                        private_slots=(min(int(max_tokens), 32) if self._private is None
                                       else int(self._private)),
                        alignment=1, device=_device(dev), engine=self._engine,
                        provider=self._provider, allgather=self._gather, timeout=self._timeout)
            self._a2a[key] = a
        return a, key

    def low_latency_dispatch(self, x: "torch.Tensor", topk_idx: "torch.Tensor",
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Any = None,
                             dispatch_wait_recv_cost_stats: Any = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False,
                             **unsupported: Any
                             ) -> Tuple[Any, "torch.Tensor", _Handle, EventOverlap,
                                        Callable[[], None]]:
        """x bf16 [T, H], topk_idx int64 [T, k] (-1 allowed) -> (recv_x, recv_count, handle,
        event, hook): recv_x = (e4m3 [E_local, max*R, H], fp32 [E_local, max*R, H/128]) with
        use_fp8, else bf16 [E_local, max*R, H]; recv_count int32 [E_local]. Refused (named in
        ferry.InvalidArgument): cumulative_local_expert_recv_stats,
        dispatch_wait_recv_cost_stats, round_scale=True, use_ue8m0=True. async_finish is
        ignored. return_recv_hook=True: sent now, received by hook(); otherwise hook() does
        nothing. Rows of expert e past recv_count[e] are not written."""
        self._check_open()
        if not self.low_latency_mode:
            raise InvalidArgument("low_latency_dispatch needs a Buffer made with "
                                  "low_latency_mode=True (False is the default, as in DeepEP)")
        _refuse_others("low_latency_dispatch", unsupported)
        _refuse("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, None,
                "no per-expert statistics are kept")
        _refuse("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, None,
                "no wait-time statistics are kept")
        _refuse("round_scale", round_scale, False, "scales are amax/448, not powers of two")
        _refuse("use_ue8m0", use_ue8m0, False, "scales are fp32")
        del async_finish  # the work is on the current stream (CUDA) or done (CPU) either way
        _integers(num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                  num_experts=num_experts)
        dev = getattr(x, "device", _CPU) if self._device is None else self._device
        _check("x", x, (torch.bfloat16,), (None, None), dev)
        t, h = int(x.shape[0]), int(x.shape[1])
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            _check("topk_idx", topk_idx, (torch.int64, torch.int32), (t, None), dev)
        k = int(topk_idx.shape[1])
        _check("topk_idx", topk_idx, (torch.int64, torch.int32), (t, k), dev)
        if t > num_max_dispatch_tokens_per_rank:
            raise InvalidArgument(f"x holds {t} tokens, more than "
                                  f"num_max_dispatch_tokens_per_rank "
                                  f"{num_max_dispatch_tokens_per_rank}")
        if use_fp8 and h % SCALE_BLOCK != 0:
            raise InvalidArgument(f"x must have a multiple of {SCALE_BLOCK} channels with "
                                  f"use_fp8, got {h}")
        e, key = self._get(x, k, num_max_dispatch_tokens_per_rank, num_experts, use_fp8)
        xs = None
        if use_fp8:
            q = torch.empty(t, h, dtype=torch.uint8, device=dev)
            xs = torch.empty(t, h // SCALE_BLOCK, dtype=torch.float32, device=dev)
            _quantize(x, q, xs)
            x = q
        e.send(x, xs, topk_idx, None, t, None)
        cap = int(num_max_dispatch_tokens_per_rank) * self.group_size
        nl = e.local_experts
        count = torch.zeros(nl, dtype=torch.int32, device=dev)
        if use_fp8:
            rx = torch.empty(nl, cap, h, dtype=torch.uint8, device=dev)
            rs = torch.empty(nl, cap, h // SCALE_BLOCK, dtype=torch.float32, device=dev)
            recv_x: Any = (rx.view(_FP8) if _FP8 is not None else rx, rs)
        else:
            rx = torch.empty(nl, cap, h, dtype=torch.bfloat16, device=dev)
            rs = None
            recv_x = rx

        def hook() -> None:
            e.recv(count, rx, rs)

        handle = _Handle(e, t, key)
        if return_recv_hook:
            return recv_x, count, handle, EventOverlap(), hook
        hook()
        return recv_x, count, handle, EventOverlap(), _noop

    def low_latency_combine(self, x: "torch.Tensor", topk_idx: "torch.Tensor",
                            topk_weights: "torch.Tensor", handle: _Handle,
                            use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional["torch.Tensor"] = None,
                            combine_wait_recv_cost_stats: Any = None, **unsupported: Any
                            ) -> Tuple["torch.Tensor", EventOverlap, Callable[[], None]]:
        """Returns ``(combined_x, event, hook)``: ``combined_x[t] = sum_k topk_weights[t, k] *
        x(t, k)``, bf16 ``[T, H]`` (into ``out`` if given), summed in fp32 in top-k order.
        ``x`` is bf16 ``[E_local, max*R, H]`` laid out like the dispatch's ``recv_x``."""
        self._check_open()
        _refuse_others("low_latency_combine", unsupported)
        _refuse("use_logfmt", use_logfmt, False, "combine carries bf16 rows")
        _refuse("zero_copy", zero_copy, False, "there is no exposed send buffer to write into")
        _refuse("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, None,
                "no wait-time statistics are kept")
        del async_finish
        if not isinstance(handle, _Handle):
            raise InvalidType("handle must be the one low_latency_dispatch returned, got "
                              f"{type(handle).__name__}")
        e, t = handle.engine, handle.num_tokens
        e.check_open("the all-to-all of this handle")
        dev = e.device
        cap = int(handle.key[0]) * self.group_size
        _check("x", x, (torch.bfloat16,), (e.local_experts, cap, e.hidden), dev)
        _check("topk_idx", topk_idx, (torch.int64, torch.int32), (t, e.topk), dev)
        _check("topk_weights", topk_weights, (torch.float32,), (t, e.topk), dev)
        _check_finite("topk_weights", topk_weights)
        if out is None:
            out = torch.empty(t, e.hidden, dtype=torch.bfloat16, device=dev)
        else:
            _check("out", out, (torch.bfloat16,), (t, e.hidden), dev)
        e.combine_send(x)

        def hook() -> None:
            e.combine_recv(out, topk_weights)

        if return_recv_hook:
            return out, EventOverlap(), hook
        hook()
        return out, EventOverlap(), _noop

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Nothing to clean: ferry's buffers carry call numbers instead of being zeroed."""

    def _check_open(self) -> None:
        if self._closed:
            raise Cancelled("ferry.moe.Buffer is closed (destroy() was called)")

    def destroy(self) -> None:
        """Collective: closes every all-to-all this buffer built (all ranks call it). Later
        calls raise ferry.Cancelled; a second destroy() does nothing."""
        self._closed = True
        for a in self._a2a.values():
            a.close()
        self._a2a.clear()

    close = destroy

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()


def _quantize(x: "torch.Tensor", q: "torch.Tensor", scales: "torch.Tensor") -> None:
    t, h = int(x.shape[0]), int(x.shape[1])
    if t == 0:
        return
    _ferry.moe_quantize_fp8(_ptr(x), t, h, _ptr(q), _ptr(scales), x.device.type == "cuda",
                            _stream(x.device))


def quantize_fp8(x: "torch.Tensor") -> Tuple["torch.Tensor", "torch.Tensor"]:
    """bf16 ``[T, H]`` -> (e4m3 ``[T, H]`` (see :func:`fp8_dtype`), fp32 scales ``[T, H/128]``),
    scale = amax / 448 per 128 channels: ferry's fp8 format, bit-identical on CPU and GPU."""
    _check("x", x, (torch.bfloat16,), (None, None), getattr(x, "device", _CPU))
    t, h = int(x.shape[0]), int(x.shape[1])
    if h % SCALE_BLOCK != 0:
        raise InvalidArgument(f"x must have a multiple of {SCALE_BLOCK} channels, got {h}")
    q = torch.empty(t, h, dtype=torch.uint8, device=x.device)
    s = torch.empty(t, h // SCALE_BLOCK, dtype=torch.float32, device=x.device)
    _quantize(x, q, s)
    return (q.view(_FP8) if _FP8 is not None else q), s


def dequantize_fp8(q: "torch.Tensor", scales: "torch.Tensor") -> "torch.Tensor":
    """The inverse of :func:`quantize_fp8`, to bf16, in torch (any device)."""
    if not isinstance(q, torch.Tensor) or not _is_fp8(q.dtype):
        raise InvalidArgument(f"q must be an fp8 tensor ({fp8_dtype()}), got "
                              f"{getattr(q, 'dtype', type(q).__name__)}")
    if not isinstance(scales, torch.Tensor) or not scales.dtype.is_floating_point:
        raise InvalidArgument(f"scales must be a floating-point torch.Tensor, got "
                              f"{getattr(scales, 'dtype', type(scales).__name__)}")
    shape = tuple(q.shape)
    if not shape:
        raise InvalidArgument("q must have at least one dimension (its last one the channels), "
                              "got a 0-dimensional tensor")
    if shape[-1] % SCALE_BLOCK != 0 or tuple(scales.shape) != shape[:-1] + (
            shape[-1] // SCALE_BLOCK,):
        raise InvalidArgument(f"scales must have shape {shape[:-1] + (shape[-1] // SCALE_BLOCK,)}"
                              f" for q of shape {shape}, got {tuple(scales.shape)}")
    qc = q.contiguous()
    bytes_ = qc.view(torch.uint8) if qc.dtype != torch.uint8 else qc
    if bytes_.device.type == "cpu":
        out = torch.empty(shape, dtype=torch.bfloat16)
        n = bytes_.numel() // shape[-1]
        if n:
            sc = scales.contiguous().to(torch.float32)
            _ferry.moe_dequantize_fp8(_ptr(bytes_), _ptr(sc), n, shape[-1], _ptr(out))
        return out
    vals = bytes_.view(_FP8).to(torch.float32)  # torch 2.x on a GPU machine
    s = scales.to(torch.float32).repeat_interleave(SCALE_BLOCK, dim=-1)
    return (vals * s).to(torch.bfloat16)
