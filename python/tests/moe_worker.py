"""One rank of the MoE tests: a spawned process that runs every scenario of a world and checks
its own results against a torch reference it computes itself.

Every rank's inputs derive from (seed, scenario, rank), so each rank rebuilds what every other
rank sends and knows exactly which rows it must receive, in ferry's order (per local expert:
senders in rank order, each sender's rows in token order), and what each of its tokens must
get back: sum over its experts of weight x expert(x), with expert e(x) = x * (1 + e/8) - e/16.
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Callable, Dict, List, Optional

H = 256  # hidden: two fp8 scale blocks
TOPK = 3
EXPERTS_PER_RANK = 3
MAX_TOKENS = 40  # above the private slots below, so skewed calls overflow them
PRIVATE = 8


def expert_fn(torch: Any, e: int, x: Any) -> Any:
    """The test's expert e on bf16 rows, output rounded to bf16."""
    return (x.float() * (1.0 + e / 8.0) - e / 16.0).to(torch.bfloat16)


def make_inputs(torch: Any, seed: int, call: int, rank: int, world: int, routing: str) -> dict:
    """Tokens, routing and weights of `rank` in one call of a scenario."""
    g = torch.Generator().manual_seed(seed * 1000003 + call * 1009 + rank)
    num_experts = EXPERTS_PER_RANK * world
    if routing == "empty" and rank == world - 1:
        t = 0
    else:
        t = int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=g))
    x = (torch.randn(t, H, generator=g) * 2).to(torch.bfloat16)
    if routing == "skewed":  # everything to one expert (of the last rank), other choices empty
        idx = torch.full((t, TOPK), -1, dtype=torch.int64)
        idx[:, 0] = num_experts - 1
    else:
        idx = torch.stack([torch.randperm(num_experts, generator=g)[:TOPK] for _ in range(t)]) \
            if t else torch.zeros(0, TOPK, dtype=torch.int64)
        holes = torch.rand(t, TOPK, generator=g) < 0.2
        idx = torch.where(holes, torch.full_like(idx, -1), idx)
    w = torch.rand(t, TOPK, generator=g)
    return {"x": x, "idx": idx.to(torch.int64), "w": w.float()}


def expected_rows(torch: Any, ins: List[dict], rank: int, payload: Callable[[int], Any]) -> list:
    """Per local expert of `rank`: the rows it must receive (payload(sender) rows), in order."""
    out = []
    for le in range(EXPERTS_PER_RANK):
        e = rank * EXPERTS_PER_RANK + le
        rows = []
        for s, d in enumerate(ins):
            hit = (d["idx"] == e).any(dim=1)
            if hit.any():
                rows.append(payload(s)[hit])
        out.append(torch.cat(rows) if rows else None)
    return out


def reference_combine(torch: Any, d: dict, expert_in: Any) -> Any:
    """fp32 sum over the token's experts of weight x expert(x), top-k order. expert_in: the
    bf16 rows the experts see (x itself, or its fp8 round trip)."""
    t = d["x"].shape[0]
    ref = torch.zeros(t, H, dtype=torch.float32)
    for k in range(TOPK):
        for i in range(t):
            e = int(d["idx"][i, k])
            if e >= 0:
                ref[i] += d["w"][i, k] * expert_fn(torch, e, expert_in[i:i + 1])[0].float()
    return ref


def close(a: Any, b: Any, what: str, rtol: float, atol: float) -> None:
    import torch

    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)}, expected {tuple(b.shape)}")
    if not torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol):
        err = (a.float() - b.float()).abs().max().item()
        raise AssertionError(f"{what}: max abs error {err} (rtol {rtol}, atol {atol})")


class World:
    def __init__(self, torch: Any, ferry: Any, rank: int, world: int, rpn: int, provider: str,
                 bootstrap: Dict[str, Any]) -> None:
        self.torch, self.ferry, self.rank, self.world = torch, ferry, rank, world
        self.rpn, self.provider, self.boot = rpn, provider, bootstrap

    def kwargs(self) -> dict:
        k = dict(ranks_per_node=self.rpn, provider=self.provider, timeout=20.0)
        if "allgather" in self.boot:
            k.update(rank=self.rank, world_size=self.world, allgather=self.boot["allgather"])
        return k

    def all_to_all(self, fp8: bool, device: str = "cpu") -> Any:
        torch = self.torch
        dt = self.ferry.moe.fp8_dtype() if fp8 else torch.bfloat16
        return self.ferry.moe.AllToAll(
            max_num_tokens=MAX_TOKENS, num_experts=EXPERTS_PER_RANK * self.world,
            expert_padding=1, hidden_dim=H, hidden_dim_scale=H // 128 if fp8 else None,
            in_dtype=dt, out_dtype=torch.bfloat16, scale_dtype=torch.float32 if fp8 else None,
            num_experts_per_token=TOPK, max_private_tokens=PRIVATE, device=device,
            **self.kwargs())


def run_pplx(w: World, seed: int, fp8: bool, routing: str, calls: int, split: bool) -> None:
    """pplx-garden-style calls, checked: counts, received rows (bytes), combine (fp32/bf16)."""
    torch, moe = w.torch, w.ferry.moe
    a = w.all_to_all(fp8)
    nl = a.num_local_experts
    cap = a.max_recv_tokens
    for call in range(calls):
        ins = [make_inputs(torch, seed, call, r, w.world, routing) for r in range(w.world)]
        if fp8:
            for d in ins:
                q, s = moe.quantize_fp8(d["x"])
                d["q"], d["s"] = q, s
                d["seen"] = moe.dequantize_fp8(q, s)  # what the experts see
        else:
            for d in ins:
                d["seen"] = d["x"]
        mine = ins[w.rank]
        t = mine["x"].shape[0]
        cnt = torch.full((nl,), -7, dtype=torch.int32)
        dt = moe.fp8_dtype() if fp8 else torch.bfloat16
        ox = torch.zeros(nl, cap, H, dtype=torch.uint8 if fp8 else torch.bfloat16)
        ox = ox.view(dt) if fp8 else ox
        osc = torch.zeros(nl, cap, H // 128, dtype=torch.float32) if fp8 else None
        dp_x = mine["q"] if fp8 else mine["x"]
        dp_s = mine["s"] if fp8 else None
        # bound_m on odd calls: a device tensor holding the count (here all the rows).
        bound = torch.tensor([t], dtype=torch.int32) if call % 2 else None
        if split:
            a.dispatch(cnt, ox, osc, dp_x, dp_s, mine["idx"], mine["w"], bound_m=bound,
                       do_send=True, do_recv=False)
            a.dispatch(cnt, ox, osc, dp_x, dp_s, mine["idx"], mine["w"], bound_m=bound,
                       do_send=False, do_recv=True)
        else:
            a.dispatch(cnt, ox, osc, dp_x, dp_s, mine["idx"], mine["w"], bound_m=bound)
        want = expected_rows(torch, ins, w.rank,
                             (lambda s: ins[s]["q"].view(torch.uint8)) if fp8
                             else (lambda s: ins[s]["x"]))
        want_s = expected_rows(torch, ins, w.rank, lambda s: ins[s]["s"]) if fp8 else None
        y = torch.zeros(nl, cap, H, dtype=torch.bfloat16)
        for le in range(nl):
            n = 0 if want[le] is None else want[le].shape[0]
            if int(cnt[le]) != n:
                raise AssertionError(f"call {call}: out_expert_num_tokens[{le}] = "
                                     f"{int(cnt[le])}, expected {n}")
            if n == 0:
                continue
            got = ox[le, :n].view(torch.uint8) if fp8 else ox[le, :n]
            if not torch.equal(got, want[le]):
                raise AssertionError(f"call {call}: rows of local expert {le} differ")
            if fp8:
                if not torch.equal(osc[le, :n], want_s[le]):
                    raise AssertionError(f"call {call}: scales of local expert {le} differ")
                seen = moe.dequantize_fp8(ox[le, :n], osc[le, :n])
            else:
                seen = ox[le, :n]
            y[le, :n] = expert_fn(torch, w.rank * nl + le, seen)
        out = torch.full((t, H), float("nan"), dtype=torch.float32 if call % 3 else torch.bfloat16)
        if split:
            a.combine(out, mine["idx"], mine["w"], y, do_send=True, do_recv=False)
            a.combine(out, mine["idx"], mine["w"], y, do_send=False, do_recv=True)
        else:
            a.combine(out, mine["idx"], mine["w"], y)
        ref = reference_combine(torch, mine, mine["seen"])
        if out.dtype == torch.float32:
            close(out, ref, f"call {call}: combine (fp32)", 1e-5, 1e-5)
        else:
            close(out, ref.to(torch.bfloat16), f"call {call}: combine (bf16)", 1e-2, 1e-2)
    a.close()


def run_deepep(w: World, seed: int, fp8: bool, routing: str, calls: int, hook: bool) -> None:
    """DeepEP low-latency calls: shapes, dtypes, counts, rows and the combined tokens."""
    torch, moe = w.torch, w.ferry.moe
    b = moe.Buffer(None, 0, 0, low_latency_mode=True, **w.kwargs())
    nl = EXPERTS_PER_RANK
    try:
        for call in range(calls):
            ins = [make_inputs(torch, seed, call, r, w.world, routing) for r in range(w.world)]
            for d in ins:
                if fp8:
                    d["q"], d["s"] = moe.quantize_fp8(d["x"])
                    d["seen"] = moe.dequantize_fp8(d["q"], d["s"])
                else:
                    d["seen"] = d["x"]
            mine = ins[w.rank]
            t = mine["x"].shape[0]
            recv_x, count, handle, event, h = b.low_latency_dispatch(
                mine["x"], mine["idx"], MAX_TOKENS, EXPERTS_PER_RANK * w.world, use_fp8=fp8,
                return_recv_hook=hook)
            event.current_stream_wait()
            h()
            cap = MAX_TOKENS * w.world
            if fp8:
                rx, rs = recv_x
                if rx.dtype != moe.fp8_dtype() or tuple(rx.shape) != (nl, cap, H):
                    raise AssertionError(f"recv_x: {rx.dtype} {tuple(rx.shape)}")
                if rs.dtype != torch.float32 or tuple(rs.shape) != (nl, cap, H // 128):
                    raise AssertionError(f"recv_x scales: {rs.dtype} {tuple(rs.shape)}")
            else:
                rx, rs = recv_x, None
                if rx.dtype != torch.bfloat16 or tuple(rx.shape) != (nl, cap, H):
                    raise AssertionError(f"recv_x: {rx.dtype} {tuple(rx.shape)}")
            if count.dtype != torch.int32 or tuple(count.shape) != (nl,):
                raise AssertionError(f"recv_count: {count.dtype} {tuple(count.shape)}")
            want = expected_rows(torch, ins, w.rank,
                                 (lambda s: ins[s]["q"].view(torch.uint8)) if fp8
                                 else (lambda s: ins[s]["x"]))
            y = torch.zeros(nl, cap, H, dtype=torch.bfloat16)
            for le in range(nl):
                n = 0 if want[le] is None else want[le].shape[0]
                if int(count[le]) != n:
                    raise AssertionError(f"call {call}: recv_count[{le}] = {int(count[le])}, "
                                         f"expected {n}")
                if n == 0:
                    continue
                got = rx[le, :n].view(torch.uint8) if fp8 else rx[le, :n]
                if not torch.equal(got, want[le]):
                    raise AssertionError(f"call {call}: rows of local expert {le} differ")
                seen = moe.dequantize_fp8(rx[le, :n], rs[le, :n]) if fp8 else rx[le, :n]
                y[le, :n] = expert_fn(torch, w.rank * nl + le, seen)
            combined, event, h = b.low_latency_combine(y, mine["idx"], mine["w"], handle,
                                                       return_recv_hook=hook)
            h()
            if combined.dtype != torch.bfloat16 or tuple(combined.shape) != (t, H):
                raise AssertionError(f"combined_x: {combined.dtype} {tuple(combined.shape)}")
            ref = reference_combine(torch, mine, mine["seen"])
            close(combined, ref.to(torch.bfloat16), f"call {call}: low_latency_combine", 1e-2,
                  1e-2)
    finally:
        b.destroy()


def _gpu_expert(torch: Any, rank: int, nl: int, rows: Any, scales: Any, y: Any) -> None:
    """expert_fn of every local expert over whole slabs (static shapes, for graph capture),
    after the fp8 round trip in torch: value * scale in fp32, then bf16, as ferry's CPU
    dequantize does."""
    seen = (rows.float() * scales.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
    e = torch.arange(rank * nl, rank * nl + nl, device=y.device, dtype=torch.float32)
    y.copy_((seen.float() * (1.0 + e / 8.0).view(nl, 1, 1) - (e / 16.0).view(nl, 1, 1))
            .to(torch.bfloat16))


def run_gpu_graph(w: World, seed: int, calls: int = 12) -> None:
    """Both ranks on GPU 0 (processes): fp8 dispatch and bf16 combine captured in a CUDA graph
    and replayed, every replay equal to the CPU backend's results on the same inputs."""
    torch, moe = w.torch, w.ferry.moe
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    g, c = w.all_to_all(True, "cuda:0"), w.all_to_all(True)
    nl, cap, m = g.num_local_experts, g.max_recv_tokens, MAX_TOKENS
    z = dict(device=dev)
    xq = torch.zeros(m, H, dtype=torch.uint8, **z)
    xq_in = xq.view(moe.fp8_dtype())
    xs = torch.ones(m, H // 128, dtype=torch.float32, **z)
    idx = torch.full((m, TOPK), -1, dtype=torch.int64, **z)
    wts = torch.zeros(m, TOPK, dtype=torch.float32, **z)
    bound = torch.zeros(1, dtype=torch.int32, **z)
    cnt = torch.zeros(nl, dtype=torch.int32, **z)
    ox = torch.zeros(nl, cap, H, dtype=torch.uint8, **z)
    osc = torch.zeros(nl, cap, H // 128, dtype=torch.float32, **z)
    y = torch.zeros(nl, cap, H, dtype=torch.bfloat16, **z)
    out = torch.zeros(m, H, dtype=torch.bfloat16, **z)
    torch.cuda.synchronize()
    g._e.allgather(b"")  # every rank's set-up (cudaMalloc) done before any kernel waits

    ox_fp8 = ox.view(moe.fp8_dtype())  # torch 2.x on the GPU machines: float8_e4m3fn

    def layer() -> None:
        g.dispatch(cnt, ox_fp8, osc, xq_in, xs, idx, wts, bound_m=bound)
        _gpu_expert(torch, w.rank, nl, ox_fp8, osc, y)
        g.combine(out, idx, wts, y, bound_m=bound)

    def load(call: int) -> dict:
        d = make_inputs(torch, seed, call, w.rank, w.world, "uniform")
        d["q"], d["s"] = moe.quantize_fp8(d["x"])
        t = d["x"].shape[0]
        xq.zero_()
        xq[:t].copy_(d["q"].view(torch.uint8))
        xs[:t].copy_(d["s"])
        idx.fill_(-1)
        idx[:t].copy_(d["idx"])
        wts[:t].copy_(d["w"])
        bound.fill_(t)
        return d

    def cpu_reference(d: dict) -> tuple:
        t = d["x"].shape[0]
        ccnt = torch.zeros(nl, dtype=torch.int32)
        cox = torch.zeros(nl, cap, H, dtype=torch.uint8).view(moe.fp8_dtype())
        cosc = torch.zeros(nl, cap, H // 128, dtype=torch.float32)
        c.dispatch(ccnt, cox, cosc, d["q"], d["s"], d["idx"], d["w"])
        cy = torch.zeros(nl, cap, H, dtype=torch.bfloat16)
        for le in range(nl):
            n = int(ccnt[le])
            if n:
                cy[le, :n] = expert_fn(torch, w.rank * nl + le,
                                       moe.dequantize_fp8(cox[le, :n], cosc[le, :n]))
        cout = torch.zeros(t, H, dtype=torch.bfloat16)
        c.combine(cout, d["idx"], d["w"], cy)
        return ccnt, cox.view(torch.uint8), cosc, cout

    def compare(call: int, d: dict) -> None:
        torch.cuda.synchronize()
        g.synchronize()
        ccnt, cox, cosc, cout = cpu_reference(d)
        t = d["x"].shape[0]
        if not torch.equal(cnt.cpu(), ccnt):
            raise AssertionError(f"call {call}: counts {cnt.cpu()} vs CPU {ccnt}")
        for le in range(nl):
            n = int(ccnt[le])
            if not torch.equal(ox[le, :n].cpu(), cox[le, :n]) or \
                    not torch.equal(osc[le, :n].cpu(), cosc[le, :n]):
                raise AssertionError(f"call {call}: rows of local expert {le} differ from CPU")
        got = out[:t].cpu()
        if not torch.equal(got, cout):
            err = (got.float() - cout.float()).abs().max().item()
            raise AssertionError(f"call {call}: combine differs from CPU, max error {err}")

    d = load(0)
    layer()  # eager, also the warm-up capture needs
    compare(0, d)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()
    for call in range(1, calls):
        d = load(call)
        graph.replay()
        compare(call, d)
    torch.cuda.synchronize()
    g.close()
    c.close()


def run_gpu_deepep(w: World, seed: int, calls: int = 3) -> None:
    """DeepEP fp8 dispatch / bf16 combine on GPU 0, equal to the same calls on CPU."""
    torch, moe = w.torch, w.ferry.moe
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    bg = moe.Buffer(None, low_latency_mode=True, device=dev, **w.kwargs())
    bc = moe.Buffer(None, low_latency_mode=True, **w.kwargs())
    try:
        for call in range(calls):
            d = make_inputs(torch, seed, call, w.rank, w.world, "uniform")
            res = []
            for b, where in ((bg, dev), (bc, torch.device("cpu"))):
                (rx, rs), cnt, handle, _, hook = b.low_latency_dispatch(
                    d["x"].to(where), d["idx"].to(where), MAX_TOKENS, EXPERTS_PER_RANK * w.world,
                    use_fp8=True, return_recv_hook=True)
                hook()
                nl, cap = rx.shape[0], rx.shape[1]
                y = torch.zeros(nl, cap, H, dtype=torch.bfloat16, device=where)
                raw = rx.view(torch.uint8)
                for le in range(nl):
                    n = int(cnt[le])
                    if n:
                        seen = moe.dequantize_fp8(rx[le, :n].cpu(), rs[le, :n].cpu())
                        y[le, :n] = expert_fn(torch, w.rank * nl + le, seen).to(where)
                out, _, hook = b.low_latency_combine(y, d["idx"].to(where), d["w"].to(where),
                                                     handle)
                hook()
                if where.type == "cuda":
                    torch.cuda.synchronize()
                res.append((cnt.cpu(), [raw[le, :int(cnt[le])].cpu() for le in range(nl)],
                            out.cpu()))
            (gc, gr, go), (cc, cr, co) = res
            if not torch.equal(gc, cc) or any(not torch.equal(a, b) for a, b in zip(gr, cr)):
                raise AssertionError(f"call {call}: GPU dispatch differs from CPU")
            if not torch.equal(go, co):
                err = (go.float() - co.float()).abs().max().item()
                raise AssertionError(f"call {call}: GPU combine differs from CPU, max {err}")
    finally:
        bg.destroy()
        bc.destroy()


GPU_SCENARIOS = {
    "gpu-pplx-fp8-graph": run_gpu_graph,
    "gpu-deepep-fp8": run_gpu_deepep,
}

SCENARIOS = {
    "pplx-bf16-holes": lambda w, s: run_pplx(w, s, False, "uniform", 3, False),
    "pplx-fp8-holes": lambda w, s: run_pplx(w, s, True, "uniform", 2, False),
    "pplx-bf16-skewed": lambda w, s: run_pplx(w, s, False, "skewed", 2, False),
    "pplx-fp8-empty-rank": lambda w, s: run_pplx(w, s, True, "empty", 2, False),
    "pplx-split-halves": lambda w, s: run_pplx(w, s, False, "uniform", 8, True),
    "deepep-fp8": lambda w, s: run_deepep(w, s, True, "uniform", 2, False),
    "deepep-bf16-hook": lambda w, s: run_deepep(w, s, False, "skewed", 2, True),
    "deepep-fp8-hook-empty": lambda w, s: run_deepep(w, s, True, "empty", 2, True),
    # Code written for pplx-garden, vLLM's and SGLang's DeepEP backends (moe_usage.py).
    "pplx-garden-fp8-bf16": lambda w, s: _usage().run_pplx_garden(
        w, s, w.ferry.moe.fp8_dtype(), w.torch.bfloat16),
    "pplx-garden-fp32": lambda w, s: _usage().run_pplx_garden(
        w, s, w.torch.float32, w.torch.float32),
    "pplx-garden-bf16": lambda w, s: _usage().run_pplx_garden(
        w, s, w.torch.bfloat16, w.torch.bfloat16),
    # pplx-garden's default flat layout ([max_recv_tokens, hidden]), padded and not.
    "pplx-garden-bf16-flat-padded": lambda w, s: _usage().run_pplx_garden(
        w, s, w.torch.bfloat16, w.torch.bfloat16, batched=False, expert_padding=16),
    "pplx-garden-fp8-flat": lambda w, s: _usage().run_pplx_garden(
        w, s, w.ferry.moe.fp8_dtype(), w.torch.bfloat16, batched=False),
    "pplx-garden-fp32-flat": lambda w, s: _usage().run_pplx_garden(
        w, s, w.torch.float32, w.torch.float32, batched=False),
    "pplx-garden-dbo-bf16": lambda w, s: _usage().run_pplx_garden_dbo(w, s, w.torch.bfloat16),
    "vllm-deepep-ll-fp8": lambda w, s: _usage().run_vllm_deepep_ll(w, s, True),
    "sglang-deepep-ll-bf16-hook": lambda w, s: _usage().run_sglang_deepep_ll(w, s, False, True),
}


def _usage() -> Any:
    import moe_usage

    return moe_usage


def main(conn: Any, rank: int, world: int, rpn: int, provider: str, bootstrap: str, port: int,
         seed: int, names: List[str]) -> None:
    results: Dict[str, Optional[str]] = {}
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)
        import ferry

        boot: Dict[str, Any] = {}
        if bootstrap == "gloo":
            import datetime

            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=60))
        else:
            def allgather(blob: bytes) -> List[bytes]:
                conn.send(("gather", bytes(blob)))
                kind, got = conn.recv()
                assert kind == "gathered"
                return got

            boot["allgather"] = allgather
        w = World(torch, ferry, rank, world, rpn, provider, boot)
        for name in names:
            try:
                (SCENARIOS.get(name) or GPU_SCENARIOS[name])(w, seed)
                results[name] = None
            except Exception:  # reported per scenario; the others still run
                results[name] = traceback.format_exc()
                break  # peers may be stuck in this scenario: stop here
    except Exception:
        results["setup"] = traceback.format_exc()
    conn.send(("done", results))
