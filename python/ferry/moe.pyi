"""ferry.moe: expert-parallel all-to-all over torch tensors (docs/PYTHON.md, "MoE")."""

from typing import Any, Callable, List, Optional, Tuple

import torch

from . import TransferEngine

SCALE_BLOCK: int
"""Channels per fp8 scale (128)."""

AllGather = Callable[[bytes], List[bytes]]
"""Setup exchange: every rank's blob, indexed by rank (collective)."""

def fp8_dtype() -> torch.dtype:
    """torch.float8_e4m3fn, or torch.uint8 (the e4m3 bytes) on a torch without float8."""

def quantize_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """bf16 [T, H] -> (e4m3 [T, H], fp32 scales [T, H/128]), scale = amax/448 per block."""

def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp8 [..., H] and scales [..., H/128] -> bf16 [..., H]."""

class AllToAll:
    """One rank's all-to-all, shaped after pplx-garden's P2PAllToAll. Collective constructor.

    max_num_tokens: most tokens a rank dispatches per call; num_experts: experts in all, split
    evenly over the ranks; num_experts_per_token: k of top-k; hidden_dim: channels per token,
    hidden_dim_scale: hidden_dim / 128 for fp8 (or None). in_dtype: the dispatch's dtype,
    torch.bfloat16, torch.float32 or fp8 (fp8_dtype()); out_dtype: the combine's (expert_y and
    out_tokens), torch.bfloat16 or torch.float32 (default: bf16 after fp8, else in_dtype), as in
    pplx-garden; scale_dtype torch.float32 (fp8 only); expert_padding pads each expert's received rows (zeros) to a multiple;
    max_private_tokens: rows per sender written before the counts are known (default
    min(max_num_tokens, 32)). device: "cpu" (CPU backend) or a CUDA device (kernels on the
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
                 hidden_dim: int, hidden_dim_scale: Optional[int] = ...,
                 in_dtype: Any = ..., out_dtype: Any = ..., scale_dtype: Any = ...,
                 num_experts_per_token: int = ..., max_private_tokens: Optional[int] = ...,
                 device: Any = ..., dp_group: Any = ..., node_group: Any = ...,
                 global_group: Any = ..., nets_per_gpu: Optional[int] = ...,
                 imm_base: Optional[int] = ..., transfer_engine: Optional[TransferEngine] = ...,
                 worker_cpu: Optional[int] = ..., max_tokens_per_expert: Optional[int] = ..., *,
                 rank: Optional[int] = ...,
                 world_size: Optional[int] = ..., ranks_per_node: Optional[int] = ...,
                 allgather: Optional[AllGather] = ..., engine: Optional[TransferEngine] = ...,
                 provider: str = ..., timeout: float = ...) -> None: ...
    rank: int
    """This rank's index in the group."""
    world_size: int
    """Ranks in the group."""
    num_local_experts: int
    """Experts this rank holds (num_experts / world_size)."""
    max_recv_tokens: int
    """Rows per local expert that out_expert_x / expert_y must hold at least."""
    max_recv_tokens_flat: int
    """Rows a flat out_expert_x [rows, H] (pplx-garden's layout) must hold at least."""

    def dispatch(self, out_expert_num_tokens: torch.Tensor, out_expert_x: torch.Tensor,
                 out_expert_x_scale: Optional[torch.Tensor], dp_x: torch.Tensor,
                 dp_x_scale: Optional[torch.Tensor], indices: torch.Tensor,
                 weights: torch.Tensor, bound_m: Optional[torch.Tensor] = ...,
                 do_send: bool = ..., do_recv: bool = ...) -> None:
        """dp_x [T, H] (in_dtype), dp_x_scale [T, H/128] fp32 (fp8), indices [T, k] int32/int64
        (-1: no expert), weights [T, k] fp32 -> out_expert_num_tokens int32 [E_local],
        out_expert_x [E_local, >= max_recv_tokens, H], out_expert_x_scale [E_local, same, H/128],
        or pplx-garden's flat layout: out_expert_x [>= max_recv_tokens_flat, H] (scales
        [same, H/128]), the local experts' rows back to back, each expert's start padded to
        expert_padding. indices may also be uint32 (pplx-garden's). bound_m: one int32/int64
        on the device, the token count (<= T). do_send / do_recv: the two halves, in that
        order. ferry.InvalidArgument names any argument of the wrong dtype, shape, device or
        layout before anything moves."""

    def dispatch_async(self, *, out_expert_num_tokens: torch.Tensor, out_expert_x: torch.Tensor,
                       out_expert_x_scale: Optional[torch.Tensor], dp_x: torch.Tensor,
                       dp_x_scale: Optional[torch.Tensor], indices: torch.Tensor,
                       weights: torch.Tensor,
                       bound_m: Optional[torch.Tensor] = ...) -> "DispatchHandle":
        """pplx-garden's dispatch_async: the send half of dispatch() now (same arguments:
        out_expert_num_tokens, out_expert_x, out_expert_x_scale, dp_x, dp_x_scale, indices,
        weights, bound_m); the returned handle's recv() receives. Two dispatches may be in
        flight (dual-batch overlap); the second uses a C++ all-to-all of its own, made
        collectively on first use. A third raises InvalidArgument."""

    def combine_async(self, *, out_tokens: torch.Tensor, dispatch_handle: "DispatchHandle",
                      expert_y: torch.Tensor, bound_m: Optional[torch.Tensor] = ...,
                      accumulate: bool = ...) -> "CombineHandle":
        """pplx-garden's combine_async: the send half of combine() for the dispatch behind
        dispatch_handle (received first; its indices and weights are used) with expert_y;
        the returned handle's recv() writes out_tokens (added with accumulate). bound_m as in
        combine()."""

    def combine(self, out_tokens: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                expert_y: torch.Tensor, bound_m: Optional[torch.Tensor] = ...,
                do_send: bool = ..., do_recv: bool = ..., accumulate: bool = ...) -> None:
        """expert_y bf16 or fp32 [E_local, >= max_recv_tokens, H] -> out_tokens [T, H] (bf16 or
        fp32): sum over k of weights[t, k] * expert_y(t, k), fp32 in top-k order (added to
        out_tokens with accumulate=True). Rows travel as bf16 (fp32 expert_y rounded); after
        an fp32 dispatch each value exactly, as three bf16 pieces, each summed in fp32: within
        fp32 accumulation's error of the float64 sum. The routing is the dispatch's (indices
        checked for shape). After a flat dispatch expert_y may be flat [rows, H] too."""

    def synchronize(self) -> None:
        """CUDA: waits for the stream, raises a device-side error. CPU: returns."""

    def close(self) -> None:
        """Collective: after every rank's last combine. Later calls raise Cancelled; a second
        close() does nothing."""

    def destroy(self) -> None:
        """pplx-garden's name for close()."""
    def __enter__(self) -> "AllToAll": ...
    def __exit__(self, *exc: Any) -> None: ...

class DispatchHandle:
    """What AllToAll.dispatch_async returns (pplx-garden's P2PDispatchHandle): the dispatch's
    tensors as attributes; recv() receives into them (once)."""
    kernel: AllToAll
    out_expert_num_tokens: torch.Tensor
    out_expert_x: torch.Tensor
    out_expert_x_scale: Optional[torch.Tensor]
    dp_x: torch.Tensor
    dp_x_scale: Optional[torch.Tensor]
    indices: torch.Tensor
    weights: torch.Tensor
    bound_m: Optional[torch.Tensor]
    recv_done: bool
    def recv(self) -> None:
        """The receive half (CUDA: after the send's event, on the current stream)."""

class CombineHandle:
    """What AllToAll.combine_async returns (pplx-garden's P2PCombineHandle)."""
    kernel: AllToAll
    dispatch_handle: DispatchHandle
    out_tokens: torch.Tensor
    expert_y: torch.Tensor
    accumulate: bool
    recv_done: bool
    def recv(self) -> None:
        """The receive half: writes out_tokens (once)."""

class EventOverlap:
    """DeepEP's event type; nothing to wait for (work is on the current stream, or done)."""
    event: Any
    def current_stream_wait(self) -> None:
        """Returns: nothing to wait for."""
    def __enter__(self) -> "EventOverlap": ...
    def __exit__(self, *exc: Any) -> None: ...

class Buffer:
    """DeepEP's Buffer, low-latency calls only. low_latency_mode defaults to False as in
    DeepEP, and low_latency_dispatch needs it True; the normal-mode calls (dispatch, combine,
    get_dispatch_layout, get_dispatch_config, get_combine_config) raise InvalidArgument.
    num_nvl_bytes / num_rdma_bytes / num_qps_per_rank are kept as attributes, unused;
    allow_nvlink_for_low_latency_mode / allow_mnnvl / explicitly_destroy are accepted, unused.
    An all-to-all is built per call shape at its first use (collective)."""

    rank: int
    group_size: int
    group: Any
    low_latency_mode: bool
    num_nvl_bytes: int
    num_rdma_bytes: int
    num_qps_per_rank: int
    explicitly_destroy: bool

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """DeepEP's sizing call: bytes one rank's buffers hold for calls of that shape (bf16
        rows, top-k up to 64), for num_rdma_bytes (which ferry does not need)."""
    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        """DeepEP's normal mode: raises ferry.InvalidArgument."""
    def combine(self, *args: Any, **kwargs: Any) -> Any:
        """DeepEP's normal mode: raises ferry.InvalidArgument."""
    def get_dispatch_layout(self, *args: Any, **kwargs: Any) -> Any:
        """DeepEP's normal mode: raises ferry.InvalidArgument."""
    @staticmethod
    def get_dispatch_config(*args: Any, **kwargs: Any) -> Any:
        """DeepEP's normal mode: raises ferry.InvalidArgument."""
    @staticmethod
    def get_combine_config(*args: Any, **kwargs: Any) -> Any:
        """DeepEP's normal mode: raises ferry.InvalidArgument."""

    def __init__(self, group: Any = ..., num_nvl_bytes: int = ..., num_rdma_bytes: int = ...,
                 low_latency_mode: bool = ..., num_qps_per_rank: int = ...,
                 allow_nvlink_for_low_latency_mode: bool = ..., allow_mnnvl: bool = ...,
                 explicitly_destroy: bool = ..., enable_shrink: bool = ..., *,
                 rank: Optional[int] = ...,
                 world_size: Optional[int] = ..., ranks_per_node: Optional[int] = ...,
                 allgather: Optional[AllGather] = ..., engine: Optional[TransferEngine] = ...,
                 provider: str = ..., device: Any = ..., private_slots: Optional[int] = ...,
                 timeout: float = ..., **unsupported: Any) -> None:
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

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Any = ...,
                             dispatch_wait_recv_cost_stats: Any = ..., use_fp8: bool = ...,
                             round_scale: bool = ..., use_ue8m0: bool = ...,
                             async_finish: bool = ..., return_recv_hook: bool = ...,
                             **unsupported: Any
                             ) -> Tuple[Any, torch.Tensor, Any, EventOverlap,
                                        Callable[[], None]]:
        """x bf16 [T, H], topk_idx int64 [T, k] (-1 allowed) -> (recv_x, recv_count, handle,
        event, hook): recv_x = (e4m3 [E_local, max*R, H], fp32 [E_local, max*R, H/128]) with
        use_fp8, else bf16 [E_local, max*R, H]; recv_count int32 [E_local]. Refused (named in
        ferry.InvalidArgument): cumulative_local_expert_recv_stats,
        dispatch_wait_recv_cost_stats, round_scale=True, use_ue8m0=True. async_finish is
        ignored. return_recv_hook=True: sent now, received by hook()."""

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: Any, use_logfmt: bool = ...,
                            zero_copy: bool = ..., async_finish: bool = ...,
                            return_recv_hook: bool = ..., out: Optional[torch.Tensor] = ...,
                            combine_wait_recv_cost_stats: Any = ..., **unsupported: Any
                            ) -> Tuple[torch.Tensor, EventOverlap, Callable[[], None]]:
        """x bf16 [E_local, max*R, H] -> (combined_x bf16 [T, H], event, hook). Refused:
        use_logfmt=True, zero_copy=True, combine_wait_recv_cost_stats."""

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None: ...
    def destroy(self) -> None:
        """Collective: closes every all-to-all this Buffer built. Later calls raise Cancelled;
        a second destroy() does nothing."""
    def close(self) -> None: ...
    def __enter__(self) -> "Buffer": ...
    def __exit__(self, *exc: Any) -> None: ...
