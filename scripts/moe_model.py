#!/usr/bin/env python3
"""A model of one MoE layer's dispatch and combine through ferry's proxied path (issue 36).

PROJECTIONS, NOT MEASUREMENTS. The model turns ferry's own schedule (which bytes each rank
writes to which peer, in how many writes, through which proxy thread and rail) and a handful
of costs into a predicted dispatch / combine / layer time. `--validate` sets it against what
ferry measured (the proxied CUDA path on one GPU over shm, and the CPU backend on the 2-core
dev VM); `--project` puts EP16..128 on p5en-like nodes beside the published figures; the
parameters, their sources and the model's limits are in docs/MOE.md ("A model of the proxied
path").

Plain Python (standard library only), so it runs where ferry does not build: no GPU, no
libfabric, no compiled module. Why a script and not `ferry bench moe --model`: the model is
arithmetic over the schedule and a parameter table that changes with every new measurement;
keeping it out of the C++ build lets anyone re-run it with their own figures (`--set`).

The schedule below mirrors the C++ code and must follow it when that changes:
  row format             include/ferry/moe/plan.h, src/moe/plan.cc (RowFormat::of, CountsFormat::of)
  parts per remote peer  src/moe/device_proxy.cc (counts, private, overflow, combine; data
                         writes of at most proxy_chunk_bytes, then a record write each)
  streamed combine       src/moe/cuda/combine.cu (pieces of whole rows within proxy_chunk_bytes)
  CPU backend puts       src/moe/cpu_backend.cc (counts, private, overflow, combine: one put each)
  rails                  src/fabric/rail_group.h (writes below stripe_threshold rotate over rails)
tests/bench/moe_model_test.py checks the schedule against ferry's measured bytes per call and
the timing against a hand-computed case.
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field

SCALE_BLOCK = 128  # channels per fp8 scale (include/ferry/moe/config.h kScaleBlock)
STRIPE_THRESHOLD = 1 << 20  # EngineConfig::stripe_threshold: above it a write is striped


def _round_up(v, a):
    return (v + a - 1) // a * a


@dataclass(frozen=True)
class Shape:
    """One layer's shape, as `ferry bench moe` takes it."""

    tokens: int = 128  # per rank and call
    hidden: int = 7168
    topk: int = 8
    experts: int = 256
    dtype: str = "fp8"  # dispatch: fp8 (one fp32 scale per 128 channels) | bf16
    combine: str = "per-hit"  # per-hit | per-rank
    private_slots: int = 32  # rows per sender written before the counts are known
    proxy_chunk: int = 256 * 1024  # CudaAllToAllOptions::proxy_chunk_bytes


def row_bytes(s):
    """RowFormat::of: header (token, call, local experts, places, hit base, weights), payload,
    fp8 scales, every part 16-byte aligned."""
    place = _round_up(8 + 2 * s.topk, 4)
    header = _round_up(place + 4 * s.topk + 4 + 4 * s.topk, 16)
    payload = _round_up(s.hidden * (1 if s.dtype == "fp8" else 2), 16)
    scales = _round_up((s.hidden // SCALE_BLOCK) * 4 if s.dtype == "fp8" else 0, 16)
    return header + payload + scales


def counts_bytes(s, world):
    """CountsFormat::of: seq, config hash, combine base, hits, rows to every rank, hits per
    local expert; padded to a cache line."""
    return _round_up((4 + world + s.experts // world) * 4, 64)


def hit_probability(s, world):
    """Chance that a token with top-k distinct uniform experts has at least one expert on a
    given rank (the bench's routing: bench_detail::random_inputs)."""
    local = s.experts // world
    if s.experts - local < s.topk:
        return 1.0
    return 1.0 - math.comb(s.experts - local, s.topk) / math.comb(s.experts, s.topk)


@dataclass
class Part:
    name: str
    bytes: float  # per remote peer
    data_writes: float  # per remote peer
    record_writes: int  # per remote peer (the proxied CUDA path's PutRecord)


@dataclass
class Schedule:
    """What one rank sends per layer, expected values under uniform routing (ranks alike)."""

    world: int
    per_node: int
    remote_peers: int
    rows_per_peer: float  # dispatched rows to each rank (self included)
    hits_per_peer: float  # (token, expert) hits on each rank
    row_bytes: int
    combine_row_bytes: int
    parts: list  # [Part] to every remote peer, in the order the proxy posts them
    dispatch_bytes_all: float  # per call, all ranks, local rows included (bench's figure)
    combine_bytes_all: float

    def part(self, name):
        return next(p for p in self.parts if p.name == name)

    def remote(self, name):
        """Bytes, writes (data + records) of a part over all remote peers of one rank."""
        p = self.part(name)
        return (p.bytes * self.remote_peers, (p.data_writes + p.record_writes) * self.remote_peers)


def _binomial_mean(tokens, prob, f):
    """E[f(rows)] with rows ~ Binomial(tokens, prob): a destination's rows per call."""
    if prob >= 1.0:
        return float(f(tokens))
    mean, sd = tokens * prob, math.sqrt(tokens * prob * (1 - prob))
    lo, hi = max(0, int(mean - 12 * sd) - 1), min(tokens, int(mean + 12 * sd) + 1)
    total = 0.0
    for r in range(lo, hi + 1):
        log_pr = (math.lgamma(tokens + 1) - math.lgamma(r + 1) - math.lgamma(tokens - r + 1)
                  + r * math.log(prob) + (tokens - r) * math.log1p(-prob))
        total += math.exp(log_pr) * f(r)
    return total


@functools.lru_cache(maxsize=None)
def schedule(s, world, per_node, path="proxied", records=1):
    """Per remote peer: the parts one rank writes, in ferry's order.

    path "proxied" (the CUDA backend's host proxy, src/moe/device_proxy.cc): counts, private
    rows, overflow rows, combine rows; every part is data writes of at most proxy_chunk bytes
    and one record write (a zero-length part still sends its record); the combine streams in
    pieces of whole rows within proxy_chunk, one write each.
    path "cpu" (src/moe/cpu_backend.cc through HostProxy): the same four puts, each one write
    (the engine splits only above max_write_size, 64 MiB), no records.
    `records` (proxied only) is not a setting of ferry's: 0 models a proxy whose records ride
    on the data writes' immediates."""
    if world % per_node:
        raise ValueError(f"ranks per node {per_node} must divide the world {world}")
    if s.experts % world:
        raise ValueError(f"experts {s.experts} must be a multiple of the world {world}")
    p = hit_probability(s, world)
    rows = s.tokens * p
    hits = s.tokens * s.topk / world
    rb = row_bytes(s)
    crow = 2 * s.hidden
    slots = min(s.private_slots, s.tokens)
    priv_rows = _binomial_mean(s.tokens, p, lambda r: min(r, slots))
    over_rows = _binomial_mean(s.tokens, p, lambda r: max(r - slots, 0))
    back_rows = rows if s.combine == "per-rank" else hits
    cnt = counts_bytes(s, world)
    if path == "proxied":
        chunk = s.proxy_chunk or 1 << 62
        rows_per_piece = max(1, chunk // crow)
        # Expected writes: each put's own piece count, averaged over the routing.
        priv_w = _binomial_mean(s.tokens, p, lambda r: math.ceil(min(r, slots) * rb / chunk))
        over_w = _binomial_mean(s.tokens, p, lambda r: math.ceil(max(r - slots, 0) * rb / chunk))
        comb_w = math.ceil(back_rows / rows_per_piece)
        parts = [
            Part("counts", cnt, 1, records),
            Part("private", priv_rows * rb, priv_w, records),
            Part("overflow", over_rows * rb, over_w, records),
            Part("combine", back_rows * crow, comb_w, records),
        ]
    elif path == "cpu":
        parts = [
            Part("counts", cnt, 1, 0),
            Part("private", priv_rows * rb, 1, 0),
            Part("overflow", over_rows * rb, 1, 0),
            Part("combine", back_rows * crow, 1, 0),
        ]
    else:
        raise ValueError(f"path {path}: proxied or cpu")
    return Schedule(
        world=world,
        per_node=per_node,
        remote_peers=world - per_node,
        rows_per_peer=rows,
        hits_per_peer=hits,
        row_bytes=rb,
        combine_row_bytes=crow,
        parts=parts,
        dispatch_bytes_all=world * world * rows * rb,
        combine_bytes_all=world * world * back_rows * crow,
    )


# --------------------------------------------------------------------------------------------
# The proxied CUDA path: kernels stage remote bytes in pinned host memory over PCIe, one proxy
# thread per rank posts them as fabric writes, the receiver's proxy raises a counter in host
# memory that the kernels poll.

INF = float("inf")


@dataclass
class ProxiedParams:
    """Costs of the proxied path. Bandwidths in GB/s (1 GB/s = 1000 bytes/us), times in us."""

    # Network, per rank.
    nic_gbps: float = 25.0  # one NIC, one direction
    nics: int = 2  # rails per rank (writes below 1 MiB rotate over them)
    latency_us: float = 10.0  # one write, post to completion at the target (one-way)
    msg_rate_mps: float = 0.0  # writes per second per NIC, millions (0: no limit)
    peer_gbps: float = INF  # one sender-receiver stream at most
    host_gbps: float = INF  # all ranks sharing one host's memory for copies, together
    host_ranks: int = 1  # ranks that share host_gbps (the whole world on a one-host run)
    # Proxy and signalling.
    write_us: float = 1.0  # proxy thread's cost to post one write (record writes included)
    records: int = 1  # record writes per part and peer (ferry: 1; 0 models records folded in)
    publish_us: float = 2.0  # a kernel's publish until the proxy acts on it
    notice_us: float = 5.0  # the receiving proxy's counter store until a kernel sees it
    # GPU <-> host memory, per GPU (shared by the ranks on it).
    pcie_store_gbps: float = 50.0  # kernels storing rows into the pinned outbox
    # dispatch_recv reading rows from the pinned inbox: one rank's warps, bound by their
    # dependent loads' latency rather than by the link, so each rank sharing a GPU gets it
    # until the link (pcie_sum_gbps) is shared out.
    pcie_read_gbps: float = 20.0
    pcie_sum_gbps: float = 50.0  # combine_recv reading rows from the pinned inbox
    ranks_per_gpu: int = 1
    # Kernels (the mapped path's times at this shape: what a same-node layer takes).
    plan_us: float = 6.0  # counts messages published
    dispatch_us: float = 35.0  # dispatch_send + dispatch_recv, same-node rows only
    expert_us: float = 16.6  # between dispatch_recv and combine_send (identity experts)
    combine_us: float = 42.5  # combine_send + combine_recv, same-node rows only


class _Lane:
    """A resource that does one thing at a time: the proxy thread, or the NIC(s)."""

    def __init__(self):
        self.free = 0.0


def egress_gbps(p, active_peers):
    """One rank's fabric bandwidth while it writes to `active_peers` peers at once."""
    return min(p.nics * p.nic_gbps, active_peers * p.peer_gbps, p.host_gbps / max(1, p.host_ranks))


def _post(p, proxy, wire, bw, ready, nbytes, writes):
    """The proxy posts `writes` writes of `nbytes` in all once `ready`; returns when the last is
    in at the peers. Posting and the wire overlap (the wire starts after the first post)."""
    post_start = max(ready, proxy.free)
    post_end = post_start + writes * p.write_us
    wire_time = nbytes / (bw * 1e3)
    if p.msg_rate_mps > 0:
        wire_time = max(wire_time, writes / (p.nics * p.msg_rate_mps))
    wire_end = max(max(post_start + p.write_us, wire.free) + wire_time, post_end)
    proxy.free, wire.free = post_end, wire_end
    return wire_end + p.latency_us


def model_proxied(s, world, per_node, p):
    """Predicted dispatch, combine and layer (us) of one rank, all ranks alike.

    dispatch: counts (published by the plan) go out at once; the private rows are stored into
    the outbox over PCIe and posted; the overflow rows wait for every peer's counts, then the
    same; the receiver reads remote rows from host memory over PCIe. combine: after the
    experts, combine_send stores each remote run piece by piece while the proxy posts the
    pieces already stored, so stores and wire overlap; the receiver sums a token as soon as
    the pieces holding its rows are in. The mapped (same-node) work runs beside all this and
    bounds each half from below."""
    sch = schedule(s, world, per_node, "proxied", records=p.records)
    out = {"schedule": sch}
    if sch.remote_peers == 0:
        out.update(dispatch=p.dispatch_us, combine=p.combine_us,
                   layer=p.dispatch_us + p.expert_us + p.combine_us)
        return out
    bw = egress_gbps(p, sch.remote_peers)
    st = p.pcie_store_gbps * 1e3 / p.ranks_per_gpu  # bytes/us per rank
    rd = min(p.pcie_read_gbps, p.pcie_sum_gbps / p.ranks_per_gpu) * 1e3
    rd_sum = p.pcie_sum_gbps * 1e3 / p.ranks_per_gpu
    proxy, wire = _Lane(), _Lane()
    cnt_b, cnt_w = sch.remote("counts")
    priv_b, priv_w = sch.remote("private")
    over_b, over_w = sch.remote("overflow")
    comb_b, comb_w = sch.remote("combine")
    counts_in = _post(p, proxy, wire, bw, p.plan_us + p.publish_us, cnt_b, cnt_w) + p.notice_us
    priv_stored = p.plan_us + priv_b / st
    priv_in = _post(p, proxy, wire, bw, priv_stored + p.publish_us, priv_b, priv_w)
    over_stored = max(counts_in, priv_stored) + over_b / st
    over_in = _post(p, proxy, wire, bw, over_stored + p.publish_us, over_b, over_w)
    rows_in = max(priv_in, over_in) + p.notice_us
    dispatch = max(rows_in + (priv_b + over_b) / rd, p.dispatch_us)

    c0 = dispatch + p.expert_us
    crow = sch.combine_row_bytes
    piece = min(max(1, s.proxy_chunk // crow) * crow if s.proxy_chunk else INF,
                comb_b / sch.remote_peers)
    first = min(comb_b, piece * sch.remote_peers)  # every peer's first piece
    stored = c0 + comb_b / st  # the last piece in the outbox
    post_start = max(c0 + first / st + p.publish_us, proxy.free)
    post_end = max(post_start + comb_w * p.write_us, stored + p.publish_us + p.write_us)
    wire_time = comb_b / (bw * 1e3)
    if p.msg_rate_mps > 0:
        wire_time = max(wire_time, comb_w / (p.nics * p.msg_rate_mps))
    wire_end = max(max(post_start + p.write_us, wire.free) + wire_time,
                   stored + p.publish_us + p.write_us + piece / (bw * 1e3), post_end)
    arrived = wire_end + p.latency_us + p.notice_us
    first_in = post_start + p.write_us + first / (bw * 1e3) + p.latency_us + p.notice_us
    read_end = max(arrived + first / rd_sum, first_in + comb_b / rd_sum)
    combine_end = max(read_end, c0 + p.combine_us)
    out.update(dispatch=dispatch, combine=combine_end - c0, layer=combine_end,
               egress_gbps=bw, writes=cnt_w + priv_w + over_w + comb_w,
               remote_bytes=priv_b + over_b + comb_b,
               breakdown={"counts in": counts_in, "private in": priv_in, "overflow in": over_in,
                          "combine stored": stored, "combine wire end": wire_end})
    return out


def model_floor(s, world, per_node, p):
    """The `--floor` write loop of `ferry bench moe`: each rank's remote dispatch rows, then
    (once every peer's are in) its combine rows, in proxy_chunk pieces, host to host; no
    kernels, no records, no counts."""
    sch = schedule(s, world, per_node, "proxied")
    if sch.remote_peers == 0:
        return 0.0
    bw = egress_gbps(p, sch.remote_peers)
    chunk = s.proxy_chunk or 1 << 62
    t = 0.0
    for nbytes_peer in (sch.rows_per_peer * sch.row_bytes,
                        sch.part("combine").bytes):
        writes = math.ceil(nbytes_peer / chunk) * sch.remote_peers
        proxy, wire = _Lane(), _Lane()
        t = _post(p, proxy, wire, bw, t, nbytes_peer * sch.remote_peers, writes)
    return t


def fit_host_bandwidth(s, world, per_node, p, floor_us):
    """The shared host bandwidth that makes model_floor equal a measured write loop (bisection;
    model_floor falls as the bandwidth grows)."""
    lo, hi = 0.01, 10000.0
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        q = dataclasses.replace(p, host_gbps=mid)
        if model_floor(s, world, per_node, q) > floor_us:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


# --------------------------------------------------------------------------------------------
# The CPU backend (`ferry bench moe --backend cpu`): the same plan, counts, private/overflow
# split and combine runs as the proxied path, one put per part and peer through a HostProxy
# thread per rank (no records, no pieces, no PCIe), same-node peers by memcpy, and the packing,
# grouping and the fp32 combine sum on the rank's own thread. On a machine with fewer cores
# than threads the cores are the bottleneck, so the model adds CPU time up over ranks.


@dataclass
class CpuParams:
    cores: float = 2.0  # cores the ranks' threads share
    # One rank alone at the same shape (`ferry bench moe --ranks 1`), us: dispatch_send (pack
    # the rows, copy them to itself), dispatch_recv (group), the experts (dequantize),
    # combine_send (stage and copy), combine_recv (the fp32 sum).
    send1_us: float = 0.0
    recv1_us: float = 0.0
    expert1_us: float = 0.0
    csend1_us: float = 0.0
    reduce1_us: float = 0.0
    write_us: float = 10.0  # CPU per fabric write (engine, proxy, provider)
    net_gbps: float = 5.0  # the provider's copy rate, one pair (`ferry bench xfer`)
    latency_us: float = 20.0  # one write, one way


def model_cpu(s, world, per_node, p):
    """Predicted per-rank dispatch, combine and layer (us) of the CPU backend."""
    sch = schedule(s, world, per_node, "cpu")
    n, t = world, s.tokens
    par = min(n, p.cores)
    rem = sch.remote_peers
    staged = n * sch.rows_per_peer  # rows packed (one per token and destination)
    local = per_node * sch.rows_per_peer  # rows copied by memcpy (self and same node)
    # Rank 1's dispatch_send packs t rows and copies t: half each.
    send = p.send1_us * (staged + local) / (2 * t)
    writes_d = 3 * rem
    disp_b = (sch.part("private").bytes + sch.part("overflow").bytes + sch.part("counts").bytes) * rem
    comb_b = sch.part("combine").bytes * rem
    # combine_send stages every hit (half of rank 1's time) and copies the same-node share.
    csend = p.csend1_us * (1 + per_node / n) / 2
    # The provider's copies are CPU work as well, done by each rank's own engine worker
    # (src/bench/moe.cc gives every rank a TransferEngine and a HostProxy thread), so they
    # share the cores with the rest rather than queueing behind one another's.
    net = p.net_gbps * 1e3
    dispatch = (n * (send + p.recv1_us + writes_d * p.write_us + disp_b / net) / par
                + (2 * p.latency_us if rem else 0))
    experts = n * p.expert1_us / par
    combine = (n * (csend + p.reduce1_us + rem * p.write_us + comb_b / net) / par
               + (p.latency_us if rem else 0))
    return {"schedule": sch, "dispatch": dispatch, "combine": combine,
            "layer": dispatch + experts + combine}


# --------------------------------------------------------------------------------------------
# Parameters with their sources, the measurements the model is checked against, the article.

# p5en-like node: 8 GPUs, 2 x 200 Gb/s EFA per GPU. Sources:
#  - bandwidth: AWS EC2 user guide, "Maximize network bandwidth on Amazon EC2 instances with
#    multiple network cards" (EFA configuration for P5/P5e);
#    https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html ; and Licker
#    et al., "RDMA Point-to-Point Communication for LLM Systems", arXiv:2510.27656 (400 Gbps
#    per GPU reached on EFA with 2 x 200 Gbps NICs).
#  - latency and message rate: AWS publishes no per-write figure for EFA; the defaults are
#    perftest's over SRD between two m6i.metal instances (an earlier EFA than p5en's), in
#    zhang1980s/ec2-efa-lab, efa-performance-testing-guide.md (GitHub): ib_send_lat one-way
#    typical 15.7-16.5 us for 2 B-1 KiB (so 16 us), ib_write_bw on one queue pair 2.1-2.2 M
#    writes/s from 4 B to 4 KiB (so 2.1 M/s per NIC: a rank posts to each rail through one
#    endpoint). Third-party measurements on older hardware: the sensitivity table halves and
#    doubles both.
#  - proxy, signalling, PCIe, kernels: ferry's own measurements (docs/BENCHMARKS.md): the
#    engine's ~1.8 us per 64 B write on the 16-core GPU host's CPUs (564k/s, 2026-12-02)
#    bounds the proxy's post cost from above; publish-to-seen 0.9 us and arrival-to-kernel
#    4-29 us from the H200 traces (2026-12-02/03); kernels storing 2 x 7 MiB of combine rows
#    into pinned host memory in 284 us (H100, 2026-12-06: ~50 GB/s), dispatch_recv reading
#    ~1 MB of rows from it in 45-70 us (H200 2026-12-03: ~20 GB/s, a warp per row with
#    dependent loads) and combine_recv 7 MiB in 100-170 us (H200 2026-12-02: taken as the
#    PCIe Gen5 x16 link's ~50 GB/s, since it overlaps the arrivals); the mapped EP2 layer on
#    one H100 (dispatch 34.9, combine 42.5, layer 94.0 us) for the kernels.
P5EN = ProxiedParams(nic_gbps=25.0, nics=2, latency_us=16.0, msg_rate_mps=2.1, write_us=1.0,
                     publish_us=2.0, notice_us=5.0, pcie_store_gbps=50.0, pcie_read_gbps=20.0,
                     pcie_sum_gbps=50.0, ranks_per_gpu=1, plan_us=6.0, dispatch_us=34.9, expert_us=16.6,
                     combine_us=42.5)

# Published dispatch + combine at the decode shape (128 tokens, hidden 7168, top-8 of 256,
# fp8 dispatch, bf16 combine), us, on p5en (8 x H200, EFA) unless said otherwise, as issue 36
# quotes them from the article it answers (pplx-garden: Perplexity, "Enabling Trillion-Parameter
# Models on AWS EFA", research.perplexity.ai, and arXiv:2510.27656).
ARTICLE = {
    "pplx-garden": {16: 459, 32: 582, 64: 692},
    "AWS rerun of pplx-garden": {16: 463, 32: 568, 64: 662, 128: 1013},
    "UCCL-EP": {16: 519, 32: 966, 64: 1159},
    "DeepEP V2 (GPU-initiated EFA, p6-b200)": {16: 385},
}

# ferry's proxied layer on one H100 over shm, 2026-12-06 (docs/BENCHMARKS.md, "One H100: the
# pip-installed package..."): `ferry bench moe --backend cuda --ranks N --ranks-per-node R
# --provider shm --tokens 128 --hidden 7168 --topk 8 --experts 256 --dtype fp8 --floor`, p50 us.
# floor_write and mapped come from the same runs and are the model's inputs (network, kernels).
H100_SHM = [
    # (N, R, tokens, layer, dispatch, combine, floor_write, mapped_layer)
    (2, 1, 128, 2288.2, 378.5, 1903.4, 2244.7, 93.6),
    (4, 2, 128, 3342.2, 781.6, 2526.6, 2852.2, 177.9),
    (8, 2, 128, 8661.0, 2664.0, 5872.8, 6763.1, 335.0),
]
# The same three runs over tcp instead of shm (out of sample: the model was written against the
# shm runs), one H100, 2026-12-07 ("The proxied path over tcp" in docs/BENCHMARKS.md):
# `ferry bench moe --backend cuda --provider tcp --floor --tokens 128 --warmup 5 --iters 50`.
H100_TCP = [
    (2, 1, 128, 2752.8, 465.6, 2278.9, 2745.9, 95.0),
    (4, 2, 128, 3674.0, 879.9, 2691.7, 4088.7, 176.6),
    (8, 2, 128, 7362.2, 2390.7, 4825.8, 6008.2, 335.2),
]
# Prefill through the proxy, one H200, 2026-12-03 ("The proxied MoE path: one poller per remote
# wait"): EP2 at 4096 tokens, layer 111.6-117.1 ms, floor (write loop + mapped layer)
# 115.2-118.4 ms; the mapped layer at 4096 tokens: 2147 us (one H100, 2026-12-06).
H200_PREFILL = (2, 1, 4096, 114350.0, None, None, 116800.0 - 2147.0, 2147.0)

# Shares of the mapped layer (dispatch, experts, combine) on one H100, 2026-12-06: decode
# 34.9 / 16.6 / 42.5 of 94.0 us; 4096 tokens 364.9 / 653.4 / 1128.7 of 2147.0 us. Applied to a
# mapped layer measured with more ranks on the GPU.
MAPPED_SHARES = {128: (34.9 / 94.0, 16.6 / 94.0, 42.5 / 94.0),
                 4096: (364.9 / 2147.0, 653.4 / 2147.0, 1128.7 / 2147.0)}



def one_host_params(world, mapped_layer, tokens=128, latency_us=2.0, write_us=1.0):
    """A run of every rank on one GPU and one host: kernels share the GPU and its PCIe link,
    copies share the host's memory (fitted to the run's own write loop by the caller)."""
    d, e, c = MAPPED_SHARES[min(MAPPED_SHARES, key=lambda t: abs(math.log(t / tokens)))]
    return ProxiedParams(nic_gbps=1e6, nics=1, latency_us=latency_us, write_us=write_us,
                         publish_us=2.0, notice_us=5.0, pcie_store_gbps=50.0,
                         pcie_read_gbps=20.0, ranks_per_gpu=world, host_ranks=world,
                         plan_us=6.0, dispatch_us=mapped_layer * d, expert_us=mapped_layer * e,
                         combine_us=mapped_layer * c)


def validate_proxied(out, runs=None, fabric="shm"):
    rows = []
    for n, r, tokens, layer, disp, comb, floor_write, mapped in runs or H100_SHM + [H200_PREFILL]:
        s = Shape(tokens=tokens)
        p = one_host_params(n, mapped, tokens)
        p = dataclasses.replace(p, host_gbps=fit_host_bandwidth(s, n, r, p, floor_write))
        m = model_proxied(s, n, r, p)
        rows.append((n, r, tokens, p.host_gbps, m, layer, disp, comb))
    out.write(f"Proxied CUDA path, every rank on one GPU, other nodes over {fabric} (p50 us). Inputs "
              "per run: its --floor write loop\n(fits the host's copy bandwidth) and its mapped "
              "layer (kernel times); PCIe and signalling from the traces.\n")
    return _compare(out, "host GB/s",
                    [(f"{n:>3} {r:>2} {tokens:>6} {hb:>9.1f}", m, disp, comb, layer)
                     for n, r, tokens, hb, m, layer, disp, comb in rows])


def _compare(out, extra, rows):
    """Predicted beside measured; returns the largest relative error of the layer."""
    out.write(f"{'EP':>3} {'R':>2} {'tokens':>6} {extra:>9} | {'dispatch pred/meas':>19} | "
              f"{'combine pred/meas':>19} | {'layer pred/meas':>19} {'error':>6}\n")

    def pair(pred, meas):
        return f"{pred:8.0f} / {meas:8.0f}" if meas else f"{pred:8.0f} /      n/a"

    worst = 0.0
    for label, m, disp, comb, layer in rows:
        err = m["layer"] / layer - 1
        worst = max(worst, abs(err))
        out.write(f"{label} | {pair(m['dispatch'], disp):>19} | {pair(m['combine'], comb):>19} | "
                  f"{pair(m['layer'], layer):>19} {err * 100:+5.0f}%\n")
    return worst


# The CPU backend on the 2-core dev VM, 2026-12-06, 23:27-23:29 UTC, load average 16-19 (four
# other sessions building on the same two cores): docs/BENCHMARKS.md, "A model of the proxied
# path against ferry's layers". `ferry bench moe --backend cpu --tokens T --iters 12 --warmup 2`
# (--iters 6 --warmup 1 at 1024 tokens), p50 us. Inputs: one rank alone at each shape, run in
# the same minutes (its phases are the CPU costs), and `ferry bench xfer --provider P`: the
# engine's CPU per 64 B write and per 4 MiB write (copy rate), its one-way latency.
CPU_ONE_RANK = {  # (dispatch_send, dispatch_recv, dispatch, combine_send, combine_recv, combine, layer)
    128: (1445.7, 6156.8, 7525.9, 24517.6, 29240.9, 53295.7, 115852.3),
    1024: (14592.0, 36201.8, 51189.8, 179961.1, 202220.2, 383683.2, 813043.3),
}
CPU_NET = {  # write_us, net_gbps, latency_us
    "shm": (2.15, 4194304 / 1159.44 / 1e3, 10.6),
    "tcp": (1.92, 4194304 / 873.23 / 1e3, 7.9),
}


def cpu_params(provider, tokens, one_rank=None, net=None, cores=2.0):
    ds, dr, d, cs, cr, c, layer = (one_rank or CPU_ONE_RANK)[tokens]
    w, bw, lat = (net or CPU_NET)[provider]
    return CpuParams(cores=cores, send1_us=ds, recv1_us=dr, expert1_us=layer - d - c,
                     csend1_us=cs, reduce1_us=cr, write_us=w, net_gbps=bw, latency_us=lat)


CPU_MEASURED = [  # (provider, N, R, tokens, dispatch, combine, layer), p50 us
    ("shm", 2, 1, 128, 14889.4, 88386.1, 211994.5),
    ("shm", 4, 2, 128, 12341.6, 56981.3, 141689.6),
    ("shm", 8, 4, 128, 52801.2, 301795.5, 567594.4),
    ("tcp", 2, 1, 128, 5903.2, 27098.3, 54600.7),
    ("tcp", 4, 2, 128, 14285.9, 62800.4, 131933.8),
    ("tcp", 8, 4, 128, 31831.5, 131671.1, 272725.3),
    ("shm", 2, 1, 1024, 33197.2, 209395.6, 435204.7),
    ("shm", 4, 2, 1024, 91662.9, 433945.4, 934405.7),
    ("tcp", 2, 1, 1024, 42675.6, 227382.5, 563476.6),
    ("tcp", 4, 2, 1024, 92374.7, 408542.7, 896696.0),
]


def validate_cpu(out, m=None):
    """The CPU backend's model beside its runs: the dev VM's (above) or a measured folder's."""
    if m is None:
        out.write("CPU backend (`ferry bench moe --backend cpu`) on the 2-core dev VM at load "
                  "16-19, p50 us (misses: see docs/MOE.md)\n")
        runs, one, net, cores = CPU_MEASURED, CPU_ONE_RANK, CPU_NET, 2.0
    else:
        runs, one, net, cores = m.cpu, m.cpu_one_rank, m.cpu_net, m.cores
        out.write(f"CPU backend (`ferry bench moe --backend cpu`) measured in {m.where} "
                  f"({cores:g} cores), p50 us. Inputs: one rank alone at each shape, "
                  "`ferry bench xfer` per provider.\n")
    rows = []
    for prov, n, r, tokens, disp, comb, layer in runs:
        if tokens not in one or prov not in net:
            out.write(f"  EP{n} {prov} {tokens} tokens: no one-rank run at {tokens} tokens or no "
                      f"`bench xfer` on {prov} among the measured files; not modelled\n")
            continue
        q = cpu_params(prov, tokens, one, net, cores)
        rows.append((f"{n:>3} {r:>2} {tokens:>6} {prov:>9}",
                     model_cpu(Shape(tokens=tokens), n, r, q), disp, comb, layer))
    return _compare(out, "provider", rows)


# --------------------------------------------------------------------------------------------
# Measured files: `--validate --measured DIR` sets the model against runs written by
# scripts/moe_validate_device.sh (or any `ferry bench moe --json` / `ferry bench xfer --json`
# files) instead of the figures above.


@dataclass
class Measured:
    where: str
    cores: float
    proxied: dict = field(default_factory=dict)  # fabric -> [(N, R, tokens, layer, d, c, floor, mapped)]
    cpu: list = field(default_factory=list)  # [(fabric, N, R, tokens, dispatch, combine, layer)]
    cpu_one_rank: dict = field(default_factory=dict)  # tokens -> CPU_ONE_RANK's tuple
    cpu_net: dict = field(default_factory=dict)  # fabric -> CPU_NET's tuple


def fabric_of(provider):
    """The fabric between nodes, from the provider a run reports: "tcp;ofi_rxm" -> "tcp",
    "cuda (rank 0 on GPU 0 of 1), other nodes over shm" -> "shm"."""
    names = re.findall(r"\b(shm|tcp|efa|verbs)\b", provider)
    return names[-1] if names else provider


def _p50(j, phase, path):
    try:
        return float(j["phases"][phase]["p50_us"])
    except KeyError:
        raise SystemExit(f"{path}: no p50 of phase {phase!r}; is it `ferry bench moe --json`?")


def load_measured(paths, cores=None):
    """Reads `ferry bench moe --json` and `ferry bench xfer --json` files (the *.json of a
    folder, or the files named). A `host.json` holding {"cores": N} says how many cores the
    runs had; else `cores`, else this machine's count."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".json"))
        else:
            files.append(path)
    if not files:
        raise SystemExit(f"--measured {' '.join(paths)}: no .json files")
    m = Measured(where=", ".join(paths), cores=0.0)
    for f in files:
        try:
            with open(f) as fh:
                j = json.load(fh)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--measured: cannot read {f}: {e}")
        if os.path.basename(f) == "host.json":
            m.cores = m.cores or float(j.get("cores", 0))
        elif j.get("benchmark") == "xfer":
            rows = {(r["kind"], r["size_bytes"]): r for r in j.get("rows", [])}
            small, big = rows.get(("small write", 64)), max(
                (r for (kind, _), r in rows.items() if kind == "write"),
                key=lambda r: r["size_bytes"], default=None)
            if not small or not big or not j.get("latency_us", {}).get("p50"):
                raise SystemExit(f"{f}: `bench xfer` needs its 64 B small-write row, a write row "
                                 "(4 MiB) and the latency point")
            m.cpu_net[fabric_of(j["provider"])] = (
                small["engine_cpu_us_per_op"],
                big["size_bytes"] / big["engine_cpu_us_per_op"] / 1e3, j["latency_us"]["p50"])
        elif j.get("backend") in ("cpu", "cuda"):
            n, r, t = j["ranks"], j["ranks_per_node"], j["tokens"]
            if (j["hidden"], j["topk"], j["experts"], j["dtype"], j["combine"]) != \
                    (7168, 8, 256, "fp8_e4m3", "per-hit"):
                raise SystemExit(f"{f}: the model's validation takes the article's shape (hidden "
                                 "7168, top-8 of 256, fp8, per-hit combine)")
            fab = fabric_of(j["provider"])
            if j["backend"] == "cuda":
                if "floor_write_us" not in j:
                    raise SystemExit(f"{f}: a proxied run needs --floor (its write loop and "
                                     "mapped layer are the model's inputs)")
                m.proxied.setdefault(fab, []).append(
                    (n, r, t, _p50(j, "layer", f), _p50(j, "dispatch", f),
                     _p50(j, "combine", f), j["floor_write_us"], j["mapped_layer_us"]))
            elif n == 1:
                m.cpu_one_rank[t] = tuple(_p50(j, ph, f) for ph in (
                    "dispatch_send", "dispatch_recv", "dispatch", "combine_send",
                    "combine_recv", "combine", "layer"))
            else:
                m.cpu.append((fab, n, r, t, _p50(j, "dispatch", f), _p50(j, "combine", f),
                              _p50(j, "layer", f)))
        else:
            raise SystemExit(f"{f}: neither `ferry bench moe --json` nor `ferry bench xfer --json`")
    m.cores = m.cores or float(cores or os.cpu_count() or 1)
    for runs in m.proxied.values():
        runs.sort(key=lambda x: (x[2], x[0]))
    m.cpu.sort(key=lambda x: (x[3], x[0], x[1]))
    return m


# One quiet machine, every run of scripts/moe_validate_device.sh: one H200 and 16 cores,
# 2026-12-07 13:24-13:28 UTC (docs/BENCHMARKS.md, "The model against one quiet GPU machine").
H200_RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "bench",
                         "data", "moe_validate_h200_2026-12-07")


def validate_measured(out, m):
    """--validate --measured: every kind of run found, predicted beside measured; returns the
    largest relative error of a layer."""
    worst = 0.0
    for fab, runs in sorted(m.proxied.items()):
        worst = max(worst, validate_proxied(out, runs, fab))
        out.write("\n")
    if m.cpu:
        worst = max(worst, validate_cpu(out, m))
        out.write("\n")
    if not m.proxied and not m.cpu:
        raise SystemExit(f"--measured {m.where}: no run of more than one rank to set the model "
                         "against")
    return worst


PROJECT_EP = (16, 32, 64, 128)


def project(out, p=P5EN, s=Shape(), per_node=8):
    out.write(f"Projection (not a measurement): ferry's proxied path on p5en-like nodes ({per_node} "
              f"GPUs, {p.nics} x {p.nic_gbps * 8:.0f} Gb/s per GPU), decode shape, us\n")
    names = list(ARTICLE)
    out.write(f"{'EP':>4} {'writes/rank':>11} {'MB out/rank':>11} {'dispatch':>9} {'combine':>8} "
              f"{'d + c':>7} | " + " | ".join(names) + "\n")
    for n in PROJECT_EP:
        m = model_proxied(s, n, per_node, p)
        pub = " | ".join(f"{ARTICLE[k].get(n, '-')!s:>{len(k)}}" for k in names)
        out.write(f"{n:>4} {m['writes']:>11.0f} {m['remote_bytes'] / 1e6:>11.2f} "
                  f"{m['dispatch']:>9.0f} {m['combine']:>8.0f} "
                  f"{m['dispatch'] + m['combine']:>7.0f} | {pub}\n")


# Parameters the sensitivity table halves and doubles, and whether "better" is larger.
SENSITIVE = ["nic_gbps", "latency_us", "msg_rate_mps", "write_us", "publish_us", "notice_us",
             "pcie_store_gbps", "pcie_read_gbps", "pcie_sum_gbps", "dispatch_us", "combine_us",
             "expert_us"]


def sensitivity(out, p=P5EN, s=Shape(), per_node=8, eps=(16, 64)):
    def total(q, n):
        m = model_proxied(s, n, per_node, q)
        return m["dispatch"] + m["combine"]
    base = {n: total(p, n) for n in eps}
    out.write("Sensitivity: dispatch + combine (us) with one parameter halved / doubled, "
              "the rest at the p5en defaults\n")
    out.write(f"{'parameter':<16} {'default':>8} | " + " | ".join(
        f"EP{n} x0.5 / x2 (base {base[n]:.0f})" for n in eps) + "\n")
    def swing_row(name, v, lo_v, hi_v):
        cells, swing = [], 0.0
        for n in eps:
            lo = total(dataclasses.replace(p, **{name: lo_v}), n)
            hi = total(dataclasses.replace(p, **{name: hi_v}), n)
            cells.append(f"{lo:7.0f} / {hi:7.0f} ({abs(hi - lo) / base[n] * 100:3.0f}%)")
            swing = max(swing, abs(hi - lo) / base[n])
        return swing, name, v, cells

    rows = [swing_row(name, getattr(p, name), getattr(p, name) * 0.5, getattr(p, name) * 2)
            for name in SENSITIVE]
    for swing, name, v, cells in sorted(rows, key=lambda r: -r[0]):
        out.write(f"{name:<16} {v:>8g} | " + " | ".join(f"{c:>30}" for c in cells) + "\n")


# What ferry's schedule would need to change: each change alone on top of today's path, then
# all of them together.
GPUDIRECT = {"pcie_store_gbps": 1e6, "pcie_read_gbps": 1e6, "pcie_sum_gbps": 1e6,
             "publish_us": 1.0, "notice_us": 1.0}
VARIANTS = [
    ("ferry today (host staging, one proxy thread, a record per part)", {}, {}),
    ("one write per part and peer (proxy_chunk 0: the combine is no longer streamed)",
     {"proxy_chunk": 0}, {}),
    ("records folded into the data writes' immediates (no record writes)", {}, {"records": 0}),
    ("per-rank combine (one bf16 partial per token and rank)", {"combine": "per-rank"}, {}),
    ("proxy posts at 0.25 us a write (a thread per NIC, or batched posts)", {}, {"write_us": 0.25}),
    ("GPUDirect RDMA: the NIC reads and writes GPU memory, GDRCopy signals (no PCIe staging)",
     {}, GPUDIRECT),
    ("all but one write per part together",
     {"combine": "per-rank"}, dict(GPUDIRECT, records=0, write_us=0.25)),
]


def variants(out, p=P5EN, per_node=8):
    out.write("What the schedule would need (projections; each change alone on today's path, "
              "then together), dispatch + combine us\n")
    out.write(f"{'change':<86} " + " ".join(f"{'EP' + str(n):>6}" for n in PROJECT_EP) + "\n")
    for name, shape_kw, param_kw in VARIANTS:
        s = dataclasses.replace(Shape(), **shape_kw)
        q = dataclasses.replace(p, **param_kw)
        cells = []
        for n in PROJECT_EP:
            m = model_proxied(s, n, per_node, q)
            cells.append(f"{m['dispatch'] + m['combine']:>6.0f}")
        out.write(f"{name:<86} " + " ".join(cells) + "\n")
    out.write(f"{'pplx-garden (published)':<86} " + " ".join(
        f"{ARTICLE['pplx-garden'].get(n, '-')!s:>6}" for n in PROJECT_EP) + "\n")


def _apply(obj, assignments):
    """`--set name=value` overrides on a parameter dataclass."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for a in assignments:
        name, _, value = a.partition("=")
        if name not in fields:
            raise SystemExit(f"--set {a}: no parameter {name!r}; known: {', '.join(fields)}")
        kind = type(getattr(obj, name))
        try:
            obj = dataclasses.replace(obj, **{name: kind(float(value)) if kind is not str else value})
        except ValueError:
            raise SystemExit(f"--set {a}: {value!r} is not a number")
    return obj


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Model of one MoE layer's dispatch and combine through ferry's proxied "
        "path. Prints projections, not measurements (docs/MOE.md).")
    ap.add_argument("--ranks", type=int, help="EP world size: predict this one point")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--combine", choices=["per-hit", "per-rank"], default="per-hit")
    ap.add_argument("--private-slots", type=int, default=32)
    ap.add_argument("--proxy-chunk", type=int, default=256 * 1024)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override a parameter of the p5en defaults (ProxiedParams)")
    ap.add_argument("--validate", action="store_true",
                    help="predicted beside measured: the proxied path on one GPU over shm, and "
                    "the CPU backend on the 2-core dev VM")
    ap.add_argument("--measured", nargs="+", metavar="PATH",
                    help="with --validate: set the model against these `ferry bench moe --json` "
                    "and `ferry bench xfer --json` files (or folders of them, e.g. what "
                    "scripts/moe_validate_device.sh writes) instead of the figures in the script")
    ap.add_argument("--cores", type=float,
                    help="with --measured: cores of the machine the CPU runs had (default: the "
                    "folder's host.json, else this machine's)")
    ap.add_argument("--project", action="store_true",
                    help="EP16..128 on p5en-like nodes beside the published figures, the "
                    "sensitivity table and the schedule changes")
    ap.add_argument("--json", action="store_true", help="one point as JSON (with --ranks)")
    a = ap.parse_args(argv)
    out = sys.stdout
    p = _apply(P5EN, a.set)
    if a.ranks:
        s = Shape(tokens=a.tokens, hidden=a.hidden, topk=a.topk, experts=a.experts,
                  dtype=a.dtype, combine=a.combine, private_slots=a.private_slots,
                  proxy_chunk=a.proxy_chunk)
        try:
            m = model_proxied(s, a.ranks, min(a.ranks_per_node, a.ranks), p)
        except ValueError as e:
            raise SystemExit(f"moe_model: {e}")
        sch = m.pop("schedule")
        res = {k: v for k, v in m.items() if k != "breakdown"}
        res["parts_per_remote_peer"] = [dataclasses.asdict(x) for x in sch.parts]
        res["remote_peers"] = sch.remote_peers
        if a.json:
            json.dump(res, out, indent=1)
            out.write("\n")
        else:
            out.write(f"projection (not a measurement), EP{a.ranks}, {sch.per_node} ranks per "
                      f"node, {a.tokens} tokens: dispatch {m['dispatch']:.0f} us, combine "
                      f"{m['combine']:.0f} us, layer {m['layer']:.0f} us (experts included)\n")
            for x in sch.parts if sch.remote_peers else []:
                out.write(f"  to each of {sch.remote_peers} remote peers: {x.name:<9} "
                          f"{x.bytes:>10.0f} B in {x.data_writes:5.2f} data + {x.record_writes} "
                          f"record write(s)\n")
            if sch.remote_peers:
                out.write(f"  one proxy thread per rank posts them, {m['writes']:.0f} writes "
                          f"per layer, parts in this order (peers in turn within a part); "
                          f"writes below 1 MiB rotate over the rank's {p.nics} rail(s): "
                          f"{m['egress_gbps']:.0f} GB/s out\n")
    if a.measured and not a.validate:
        raise SystemExit("--measured is for --validate")
    if a.validate and a.measured:
        worst = validate_measured(out, load_measured(a.measured, a.cores))
        out.write(f"largest error of a layer: {worst * 100:.0f}%\n")
    elif a.validate:
        validate_proxied(out)
        out.write("\n")
        validate_proxied(out, H100_TCP, "tcp")
        out.write("\n")
        validate_cpu(out)
        out.write("\n")
        if os.path.isdir(H200_RUNS):
            validate_measured(out, load_measured([H200_RUNS]))
    if a.project or not (a.ranks or a.validate):
        project(out, p)
        out.write("\n")
        sensitivity(out, p)
        out.write("\n")
        variants(out, p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
