"""Code written for the libraries ferry.moe stands in for, run on ferry: the call sequences of
pplx-garden's P2PAllToAll tests (test_p2p_all_to_all: batched and flat layouts, padded;
test_dbo_smoke: dispatch_async / combine_async, two micro-batches overlapped) and of vLLM's and
SGLang's DeepEP low-latency backends, with
ferry imported under the name they import (the one line that differs), each rank checking
its results (moe_worker.py's scenarios call these).

What is not theirs: the group objects (a stand-in for pplx-garden's ParallelGroup, or the
test's torch.distributed group), the fabric settings of the test's world (ranks per node,
provider), and helpers that dequantize fp8 on a torch without float8 dtypes (1.13)."""

from __future__ import annotations

from typing import Any, List, Optional


class ParallelGroup:
    """pplx-garden's ParallelGroup as its P2PAllToAll uses it: rank, size, all_gather_object
    and barrier, over the test world's all-gather (or torch.distributed)."""

    def __init__(self, w: Any, ranks: Optional[List[int]] = None) -> None:
        self._w = w
        self._ranks = list(range(w.world)) if ranks is None else ranks
        self.rank = self._ranks.index(w.rank)
        self.size = len(self._ranks)

    def all_gather_object(self, obj: Any) -> List[Any]:
        if "allgather" in self._w.boot:
            every = self._w.boot["allgather"](obj)
        else:
            import torch.distributed as dist

            every: List[Any] = [None] * self._w.world
            dist.all_gather_object(every, obj)
        return [every[r] for r in self._ranks]

    def barrier(self) -> None:
        self.all_gather_object(b"")

    def slice_by_count(self, count: int) -> "ParallelGroup":
        per = self.size // count
        first = self.rank // per * per
        return ParallelGroup(self._w, [self._ranks[i] for i in range(first, first + per)])


def _fabric(w: Any) -> dict:
    """ferry's own keywords for the test world: how to reach the ranks of other nodes."""
    return dict(provider=w.provider, timeout=20.0)


# pplx-garden ---------------------------------------------------------------------------------

class _RankTestData:
    """One rank's tokens, scales, routing (distinct experts, int32: torch 1.13 has no uint32)
    and weights summing to 1 per token, as pplx-garden's test data."""

    def __init__(self, torch: Any, moe: Any, seed: int, rank: int, num_experts: int, k: int,
                 max_num_tokens: int, hidden_dim: int, in_dtype: Any, scales: bool) -> None:
        g = torch.Generator().manual_seed(seed * 7919 + rank)
        t = int(torch.randint(1, max_num_tokens + 1, (1,), generator=g))
        x = torch.randn(t, hidden_dim, generator=g)
        if scales:
            self.dp_x, self.dp_x_scale = moe.quantize_fp8(x.to(torch.bfloat16))
        else:
            self.dp_x, self.dp_x_scale = x.to(in_dtype), None
        self.indices = torch.stack([torch.randperm(num_experts, generator=g)[:k]
                                    for _ in range(t)]).to(torch.int32)
        self.weights = torch.softmax(torch.rand(t, k, generator=g), dim=1)
        self.bound_m = torch.tensor([t], dtype=torch.int32)
        self.expected_num_tokens = torch.bincount(self.indices.flatten().long(),
                                                  minlength=num_experts).to(torch.int32)


def run_pplx_garden(w: Any, seed: int, in_dtype: Any, out_dtype: Any, batched: bool = True,
                    expert_padding: int = 1) -> None:
    """pplx-garden's test_p2p_all_to_all worker: batched ([experts, max_tokens_per_expert,
    hidden], its _Config.max_tokens_per_expert set) or flat ([max_recv_tokens, hidden], the
    experts' rows back to back, each start padded to expert_padding: its default)."""
    torch = w.torch
    from ferry.moe import AllToAll as P2PAllToAll  # pplx_garden.kernels.p2p_all_to_all
    from ferry.moe import dequantize_fp8, fp8_dtype

    fp8 = in_dtype == fp8_dtype()
    device = torch.device("cpu")
    global_group = ParallelGroup(w)
    node_group = global_group.slice_by_count(w.world // w.rpn)
    max_num_tokens, num_experts, num_experts_per_token = 24, 4 * w.world, 3
    hidden_dim = 256
    hidden_dim_scale = hidden_dim // 128 if fp8 else None
    scale_dtype = torch.float32 if fp8 else None
    num_dp_groups = global_group.size
    dp_rank = global_group.rank
    num_local_experts = num_experts // num_dp_groups
    first_expert = dp_rank * num_local_experts
    last_expert = first_expert + num_local_experts
    max_tokens_per_expert = max_num_tokens * num_dp_groups if batched else None
    max_recv_tokens = max_num_tokens * num_local_experts * num_dp_groups

    def _act(x: Any, x_scale: Any) -> Any:
        if x_scale is None:
            return x * 2
        return dequantize_fp8(x, x_scale).to(torch.float32) * 2

    rank_data = [_RankTestData(torch, w.ferry.moe, seed, r, num_experts, num_experts_per_token,
                               max_num_tokens, hidden_dim, in_dtype, fp8)
                 for r in range(num_dp_groups)]
    local_rank = rank_data[dp_rank]
    ref_out_tokens = _act(local_rank.dp_x, local_rank.dp_x_scale).to(out_dtype)

    all_to_all = P2PAllToAll(
        max_num_tokens=max_num_tokens,
        num_experts=num_experts,
        expert_padding=expert_padding,
        hidden_dim=hidden_dim,
        hidden_dim_scale=hidden_dim_scale,
        max_private_tokens=None,
        in_dtype=in_dtype,
        out_dtype=out_dtype,
        scale_dtype=scale_dtype,
        num_experts_per_token=num_experts_per_token,
        nets_per_gpu=1,
        device=device,
        dp_group=None,
        node_group=node_group,
        global_group=global_group,
        max_tokens_per_expert=max_tokens_per_expert,
        **_fabric(w),
    )
    try:
        expected_num_tokens = torch.stack([d.expected_num_tokens for d in rank_data]).sum(
            dim=0, dtype=torch.int32)
        expert_num_tokens = torch.empty((num_local_experts,), dtype=torch.int32, device=device)
        if max_tokens_per_expert is None:
            out_expert_x_shape = (max_recv_tokens, hidden_dim)
        else:
            out_expert_x_shape = (num_local_experts, max_tokens_per_expert, hidden_dim)
        out_expert_x = torch.empty(out_expert_x_shape, dtype=in_dtype, device=device)
        out_tokens = torch.empty((local_rank.dp_x.shape[0], hidden_dim), dtype=out_dtype,
                                 device=device)
        out_expert_x_scale = None
        if hidden_dim_scale is not None or scale_dtype is not None:
            if max_tokens_per_expert is None:
                out_expert_x_scale_shape = (max_recv_tokens, hidden_dim_scale)
            else:
                out_expert_x_scale_shape = (num_local_experts, max_tokens_per_expert,
                                            hidden_dim_scale)
            out_expert_x_scale = torch.empty(out_expert_x_scale_shape, dtype=scale_dtype,
                                             device=device)

        all_to_all.dispatch(
            out_expert_num_tokens=expert_num_tokens,
            out_expert_x=out_expert_x,
            out_expert_x_scale=out_expert_x_scale,
            dp_x=local_rank.dp_x,
            dp_x_scale=local_rank.dp_x_scale,
            indices=local_rank.indices,
            weights=local_rank.weights,
            bound_m=None,
        )
        expert_y = _expert_forward(torch, _act, out_expert_x, out_expert_x_scale, out_dtype)
        all_to_all.combine(
            out_tokens=out_tokens,
            indices=local_rank.indices,
            weights=local_rank.weights,
            expert_y=expert_y,
            bound_m=local_rank.bound_m,
        )

        expected_local_tokens = expected_num_tokens[first_expert:last_expert]
        torch.testing.assert_close(expected_local_tokens, expert_num_tokens.to("cpu"))

        def token_key(x: Any) -> bytes:
            return x.contiguous().view(torch.uint8).numpy().tobytes()

        tokens_on_rank = set()
        index = 0
        for expert, n in enumerate(expected_local_tokens.tolist()):
            if out_expert_x.ndim == 3:
                expert_tokens = out_expert_x[expert, :n]
            else:
                expert_tokens = out_expert_x[index:index + n]
            for token in expert_tokens:
                tokens_on_rank.add(token_key(token))
            if out_expert_x.ndim == 2:
                index = round_up(index + n, expert_padding)
    finally:
        all_to_all.destroy()

    missing = [i for i, (token, routes) in enumerate(zip(list(local_rank.dp_x),
                                                          local_rank.indices.tolist()))
               if any(first_expert <= r < last_expert for r in routes)
               and token_key(token) not in tokens_on_rank]
    assert not missing, f"tokens {missing} not found on rank {dp_rank}"
    # Verify the combine output.
    torch.testing.assert_close(out_tokens, ref_out_tokens)


def round_up(x: int, m: int) -> int:  # pplx_garden.utils.math
    return (x + m - 1) // m * m


def _expert_forward(torch: Any, act: Any, out_expert_x: Any, out_expert_x_scale: Any,
                    out_dtype: Any) -> Any:
    """pplx-garden's tests' expert: _act on the flat rows, in the layout of out_expert_x."""
    if out_expert_x.ndim == 3:
        num_local_experts, max_tokens_per_expert, hidden_dim = out_expert_x.shape
        flat_out_expert_x = out_expert_x.reshape(-1, hidden_dim)
        flat_out_expert_x_scale = (None if out_expert_x_scale is None
                                   else out_expert_x_scale.reshape(-1,
                                                                   out_expert_x_scale.shape[-1]))
    else:
        flat_out_expert_x, flat_out_expert_x_scale = out_expert_x, out_expert_x_scale
    if flat_out_expert_x_scale is not None:
        # Rows past the counts are not written: keep their garbage out of the expert.
        flat_out_expert_x_scale = torch.nan_to_num(flat_out_expert_x_scale)
    expert_y = act(flat_out_expert_x, flat_out_expert_x_scale).to(out_dtype)
    return expert_y.reshape(out_expert_x.shape)


def run_pplx_garden_dbo(w: Any, seed: int, in_dtype: Any) -> None:
    """pplx-garden's test_dbo_smoke worker: two micro-batches, each dispatched and combined
    synchronously for a reference, then overlapped through dispatch_async / combine_async
    (B dispatched before A is combined), flat layout; the overlapped results must equal the
    reference."""
    torch = w.torch
    from ferry.moe import AllToAll as P2PAllToAll  # pplx_garden.kernels.p2p_all_to_all

    device = torch.device("cpu")
    global_group = ParallelGroup(w)
    out_dtype = in_dtype
    max_num_tokens, num_experts, hidden_dim, num_experts_per_token = 16, 4 * w.world, 256, 2
    num_dp_groups, dp_rank = global_group.size, global_group.rank
    num_local_experts = num_experts // num_dp_groups
    max_recv_tokens = max_num_tokens * num_local_experts * num_dp_groups

    def _act(x: Any, x_scale: Any) -> Any:
        return x * 2

    data_a = _RankTestData(torch, w.ferry.moe, seed, dp_rank, num_experts,
                           num_experts_per_token, max_num_tokens, hidden_dim, in_dtype, False)
    data_b = _RankTestData(torch, w.ferry.moe, seed + 100, dp_rank, num_experts,
                           num_experts_per_token, max_num_tokens, hidden_dim, in_dtype, False)
    all_to_all = P2PAllToAll(
        max_num_tokens=max_num_tokens, num_experts=num_experts, expert_padding=1,
        hidden_dim=hidden_dim, hidden_dim_scale=None, max_private_tokens=None,
        in_dtype=in_dtype, out_dtype=out_dtype, scale_dtype=None,
        num_experts_per_token=num_experts_per_token, nets_per_gpu=1, device=device,
        dp_group=None, node_group=None, global_group=global_group, **_fabric(w))
    try:
        def outputs(data: Any) -> tuple:
            return (torch.empty((num_local_experts,), dtype=torch.int32, device=device),
                    torch.empty((max_recv_tokens, hidden_dim), dtype=in_dtype, device=device),
                    torch.empty(data.dp_x.shape, dtype=out_dtype, device=device))

        refs = []
        for data in (data_a, data_b):  # 1. reference synchronous runs
            num, x, out = outputs(data)
            all_to_all.dispatch(out_expert_num_tokens=num, out_expert_x=x,
                                out_expert_x_scale=None, dp_x=data.dp_x, dp_x_scale=None,
                                indices=data.indices, weights=data.weights, bound_m=None)
            all_to_all.combine(out_tokens=out, indices=data.indices, weights=data.weights,
                               expert_y=_expert_forward(torch, _act, x, None, out_dtype),
                               bound_m=data.bound_m)
            refs.append((num, out))
        (num_a, x_a, out_a), (num_b, x_b, out_b) = outputs(data_a), outputs(data_b)
        out_a.zero_()
        out_b.zero_()
        # 2. dual batch overlap
        dispatch_handle_a = all_to_all.dispatch_async(
            out_expert_num_tokens=num_a, out_expert_x=x_a, out_expert_x_scale=None,
            dp_x=data_a.dp_x, dp_x_scale=None, indices=data_a.indices,
            weights=data_a.weights, bound_m=None)
        dispatch_handle_a.recv()
        dispatch_handle_b = all_to_all.dispatch_async(
            out_expert_num_tokens=num_b, out_expert_x=x_b, out_expert_x_scale=None,
            dp_x=data_b.dp_x, dp_x_scale=None, indices=data_b.indices,
            weights=data_b.weights, bound_m=None)
        expert_y_a = _expert_forward(torch, _act, x_a, None, out_dtype)
        dispatch_handle_b.recv()
        combine_handle_a = all_to_all.combine_async(
            out_tokens=out_a, dispatch_handle=dispatch_handle_a, expert_y=expert_y_a,
            bound_m=data_a.bound_m)
        expert_y_b = _expert_forward(torch, _act, x_b, None, out_dtype)
        combine_handle_a.recv()
        combine_handle_b = all_to_all.combine_async(
            out_tokens=out_b, dispatch_handle=dispatch_handle_b, expert_y=expert_y_b,
            bound_m=data_b.bound_m)
        combine_handle_b.recv()
        # 3. verify
        torch.testing.assert_close(out_a, refs[0][1])
        torch.testing.assert_close(out_b, refs[1][1])
        torch.testing.assert_close(num_a, refs[0][0])
        torch.testing.assert_close(num_b, refs[1][0])
        # and right: weights sum to 1, so the combine of 2x is 2x
        torch.testing.assert_close(out_a, _act(data_a.dp_x, None).to(out_dtype))
    finally:
        all_to_all.destroy()


# DeepEP low latency, as vLLM and SGLang call it -----------------------------------------------

def _group(w: Any) -> Any:
    """The torch group the engines hand DeepEP, where the test world has one."""
    if "allgather" in w.boot:
        return None
    import torch.distributed as dist

    return dist.group.WORLD


def _boot(w: Any) -> dict:
    """ferry's keywords for a world that meets through the test's all-gather (no torch group),
    and the world's fabric."""
    k = dict(ranks_per_node=w.rpn, **_fabric(w))
    if "allgather" in w.boot:
        k.update(rank=w.rank, world_size=w.world, allgather=w.boot["allgather"])
    return k


def _check_ll(w: Any, ins: List[dict], recv_x: Any, count: Any, fp8: bool) -> Any:
    """Counts and rows of a low-latency dispatch against moe_worker's reference; returns the
    experts' outputs laid out like recv_x."""
    import moe_worker as mw

    torch, moe = w.torch, w.ferry.moe
    rx, rs = recv_x if fp8 else (recv_x, None)
    nl = count.shape[0]
    want = mw.expected_rows(torch, ins, w.rank, (lambda s: ins[s]["q"].view(torch.uint8))
                            if fp8 else (lambda s: ins[s]["x"]))
    y = torch.zeros(rx.shape, dtype=torch.bfloat16)
    for le in range(nl):
        n = 0 if want[le] is None else want[le].shape[0]
        assert int(count[le]) == n, f"count[{le}] = {int(count[le])}, expected {n}"
        if n:
            got = rx[le, :n].view(torch.uint8) if fp8 else rx[le, :n]
            assert torch.equal(got, want[le]), f"rows of local expert {le} differ"
            seen = moe.dequantize_fp8(rx[le, :n], rs[le, :n]) if fp8 else rx[le, :n]
            y[le, :n] = mw.expert_fn(torch, w.rank * nl + le, seen)
    return y


def _inputs(w: Any, seed: int, call: int, fp8: bool) -> List[dict]:
    import moe_worker as mw

    ins = [mw.make_inputs(w.torch, seed, call, r, w.world, "uniform") for r in range(w.world)]
    for d in ins:
        if fp8:
            d["q"], d["s"] = w.ferry.moe.quantize_fp8(d["x"])
            d["seen"] = w.ferry.moe.dequantize_fp8(d["q"], d["s"])
        else:
            d["seen"] = d["x"]
    return ins


def run_vllm_deepep_ll(w: Any, seed: int, use_fp8_dispatch: bool) -> None:
    """vLLM's DeepEPLLAll2AllManager (buffer) and DeepEPLLPrepareAndFinalize (calls)."""
    import moe_worker as mw

    import ferry.moe as deep_ep  # import deep_ep

    torch = w.torch
    max_tokens_per_rank, hidden = mw.MAX_TOKENS, mw.H
    num_global_experts = mw.EXPERTS_PER_RANK * w.world
    num_local_experts = mw.EXPERTS_PER_RANK
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=max_tokens_per_rank,
        hidden=hidden,
        num_ranks=w.world,
        num_experts=num_global_experts,
    )
    assert num_rdma_bytes is not None
    buffer = deep_ep.Buffer(
        group=_group(w),
        num_nvl_bytes=1024 * 1024 * 1024,
        num_rdma_bytes=num_rdma_bytes,
        low_latency_mode=True,
        num_qps_per_rank=num_local_experts,
        allow_nvlink_for_low_latency_mode=True,
        allow_mnnvl=False,
        explicitly_destroy=True,
        enable_shrink=False,
        **_boot(w),
    )
    try:
        for call in range(2):
            ins = _inputs(w, seed, call, use_fp8_dispatch)
            mine = ins[w.rank]
            a1, topk_ids, topk_weights = mine["x"], mine["idx"], mine["w"]
            # prepare()
            expert_x, expert_num_tokens, handle, event, hook = buffer.low_latency_dispatch(
                a1, topk_ids, max_tokens_per_rank, num_global_experts,
                use_fp8=use_fp8_dispatch, async_finish=False, return_recv_hook=False)
            fused_expert_output = _check_ll(w, ins, expert_x, expert_num_tokens,
                                            use_fp8_dispatch)
            # finalize()
            output = torch.empty_like(a1)
            _, event, hook = buffer.low_latency_combine(
                fused_expert_output, topk_ids, topk_weights, handle, async_finish=False,
                zero_copy=False, return_recv_hook=False, out=output)
            ref = mw.reference_combine(torch, mine, mine["seen"])
            mw.close(output, ref.to(torch.bfloat16), f"call {call}: combine", 1e-2, 1e-2)
    finally:
        buffer.destroy()


def run_sglang_deepep_ll(w: Any, seed: int, use_fp8: bool, return_recv_hook: bool) -> None:
    """SGLang's DeepEPBuffer.get_deepep_buffer (low-latency mode) and its low-latency
    dispatcher: dispatch_a / dispatch_b, combine_a / combine_b, clean_buffer."""
    import moe_worker as mw

    from ferry.moe import Buffer  # from deep_ep import Buffer

    torch = w.torch
    group = _group(w)
    group_size = w.world if group is None else group.size()
    hidden_size, num_experts = mw.H, mw.EXPERTS_PER_RANK * w.world
    num_max_dispatch_tokens_per_rank = mw.MAX_TOKENS
    num_nvl_bytes, num_rdma_bytes = 0, 0
    num_rdma_bytes = max(
        Buffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank, hidden_size, group_size, num_experts),
        num_rdma_bytes,
    )
    num_qps_per_rank = num_experts // group_size
    buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True,
                    num_qps_per_rank=num_qps_per_rank, allow_mnnvl=True, **_boot(w))
    try:
        for call in range(2):
            ins = _inputs(w, seed, 100 + call, use_fp8)
            mine = ins[w.rank]
            hidden_states, topk_weights = mine["x"], mine["w"]
            topk_ids = mine["idx"].to(torch.int64)
            # dispatch_a
            expected_m = (hidden_states.shape[0] * buffer.group_size * topk_ids.shape[1]
                          + num_experts) // num_experts
            assert expected_m >= 0
            packed_recv_hidden, packed_recv_count, handle, event, hook = (
                buffer.low_latency_dispatch(
                    hidden_states, topk_ids, num_max_dispatch_tokens_per_rank, num_experts,
                    use_fp8=use_fp8, async_finish=not return_recv_hook,
                    return_recv_hook=return_recv_hook))
            # dispatch_b
            hook() if return_recv_hook else event.current_stream_wait()
            if isinstance(packed_recv_hidden, tuple):
                hs, hs_scale = packed_recv_hidden
                assert hs_scale is not None
            y = _check_ll(w, ins, packed_recv_hidden, packed_recv_count, use_fp8)
            # combine_a / combine_b
            combined, event, hook = buffer.low_latency_combine(
                x=y, topk_idx=topk_ids, topk_weights=topk_weights, handle=handle,
                async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
            hook() if return_recv_hook else event.current_stream_wait()
            ref = mw.reference_combine(torch, mine, mine["seen"])
            mw.close(combined, ref.to(torch.bfloat16), f"call {call}: combine", 1e-2, 1e-2)
            # DeepEPBuffer.clean_buffer (on a switch back from normal mode)
            if buffer.low_latency_mode:
                buffer.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden_size,
                                                num_experts)
    finally:
        buffer.destroy()
