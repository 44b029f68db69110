// Dispatch kernels: plan (every token's row at each destination and place among the rows
// that chose each expert, counts messages to every peer), send (rows straight into peers'
// private slots, then, once every peer's counts are here, the rest into the overflow run at
// the offset all ranks derive from the counts matrix), and recv (each row copied to the
// places its header names: grouped per local expert, in the order the CPU backend produces).
#include <cub/block/block_scan.cuh>

#include "common/cuda_check.h"
#include "moe/cuda/device_common.cuh"
#include "moe/cuda/kernels.h"

namespace ferry::moe::cuda {
namespace {

// Tiles of 512 tokens keep the plan's shared memory (two lane masks per warp and expert,
// the tile's routing) near 50 KiB at 256 experts, so it finds an SM even beside other
// ranks' waiting kernels when ranks share a GPU.
constexpr uint32_t kPlanThreads = 512;
constexpr uint32_t kPlanWarps = kPlanThreads / 32;
constexpr uint32_t kRecvThreads = 256;
// A small call spreads each row over up to this many warps, so every SM gets work.
constexpr uint32_t kMaxRowPieces = 8;

using PlanScan = cub::BlockScan<uint32_t, kPlanThreads>;

__device__ __forceinline__ uint32_t lanemask_lt(uint32_t lane) { return (1u << lane) - 1u; }

// Remote rank d sends our tokens' results back as one compact run (the CPU backend's order:
// token order, a token's hits in top-k order) starting at the base we announce in the counts
// message; combine_slot tells combine_recv where each (token, k) landed, and hit_base (the
// row header's) tells d where each of our rows' results go in that run. Returns the hits to d.
__device__ uint32_t assign_remote_combine_rows(const KernelArgs& a, uint32_t d, uint32_t n,
                                               uint32_t base, PlanScan::TempStorage& scan_tmp,
                                               uint32_t* s_combine_base) {
    const uint32_t tid = threadIdx.x, k = a.topk, nl = a.local_experts;
    uint32_t carry = 0;
    for (uint32_t b = 0; b < n; b += blockDim.x) {
        const uint32_t t = b + tid;
        uint32_t hits = 0;
        if (t < n)
            for (uint32_t j = 0; j < k; ++j) {
                const int32_t e = a.indices[t * k + j];
                hits += e >= 0 && static_cast<uint32_t>(e) / nl == d;
            }
        uint32_t pre, agg;
        PlanScan(scan_tmp).ExclusiveSum(hits, pre, agg);
        if (t < n) {
            a.hit_base[uint64_t{t} * a.world + d] = carry + pre;
            uint32_t at = a.remote_combine + base + carry + pre;
            for (uint32_t j = 0; j < k; ++j) {
                const int32_t e = a.indices[t * k + j];
                if (e >= 0 && static_cast<uint32_t>(e) / nl == d) a.combine_slot[t * k + j] = at++;
            }
        }
        carry += agg;
        __syncthreads();  // scan_tmp is reused
    }
    if (tid == 0) {
        s_combine_base[d] = base;
        if (a.combine_base) a.combine_base[d] = base;
    }
    return carry;
}

// Single block, tokens in tiles of 512 (one per thread, a warp's 32 tokens in lane order).
// Per tile every warp marks, per expert and per destination, which of its tokens chose it
// (a 32-bit lane mask in shared memory); a prefix over the warps' popcounts then gives every
// token its row at each destination and its place among the rows that chose each expert,
// in token order, with no block-wide scan per destination or per expert.
//
// kTopk: top-k known at compile time (the common 8), so the routing's index arithmetic and
// loops fold; 0: read from the arguments.
//
// kFused: run by block 0 of the fused send kernel, which tells the grid's other blocks that
// the plan is done (a.tickets[kTicketPlan] = call number) as soon as what the send needs is
// stored, before the counts messages go out. Returns the call number.
template <uint32_t kTopk, bool kFused>
__device__ __forceinline__ uint32_t plan_block(const KernelArgs& a, const int32_t* indices,
                                               const int64_t* indices64, const float* weights,
                                               const uint32_t* num_tokens) {
    __shared__ PlanScan::TempStorage scan_tmp;
    __shared__ uint32_t s_seq, s_n;
    __shared__ uint32_t s_hits_to[kMaxCudaWorld], s_combine_base[kMaxCudaWorld];
    extern __shared__ uint32_t plan_smem[];
    const uint32_t tid = threadIdx.x, w = a.world, k = kTopk ? kTopk : a.topk;
    const uint32_t nl = a.local_experts, ne = a.num_experts, lane = tid & 31u, warp = tid / 32;
    uint32_t* s_bits = plan_smem;                  // [warp][expert] lanes that chose the expert
    uint32_t* s_pre = s_bits + kPlanWarps * ne;    // [warp][expert] earlier tokens' choices
    uint32_t* s_ecount = s_pre + kPlanWarps * ne;  // [expert] tokens so far
    uint32_t* s_rbits = s_ecount + ne;             // [warp][dest] lanes sending to d
    uint32_t* s_rpre = s_rbits + kPlanWarps * w;   // [warp][dest] earlier tokens' rows to d
    uint32_t* s_rows = s_rpre + kPlanWarps * w;    // [dest] rows so far
    int32_t* s_idx = reinterpret_cast<int32_t*>(s_rows + w);  // [token][k] of the tile
    if (tid == 0) {
        if (a.trace) {
            for (uint32_t i = 0; i < kTracePoints; ++i) {
                a.trace[i] = ~0ull;
                a.trace[kTracePoints + i] = 0;
            }
        }
        trace_point(a, kTrPlanBegin);
        // Both loads before the store: the store could alias num_tokens, so a load after it
        // would wait for the first load's whole round trip.
        const uint64_t seq = a.state->seq + 1;
        uint32_t n = *num_tokens;
        a.state->seq = seq;
        if (n > a.max_tokens) {
            record_error(a, DeviceError::kTooMany, DeviceError::kPlan, a.rank,
                         static_cast<uint32_t>(seq), n, a.max_tokens);
            n = 0;
        }
        a.state->num_tokens = n;
        s_seq = static_cast<uint32_t>(seq);
        s_n = n;
    }
    for (uint32_t i = tid; i < ne; i += blockDim.x) s_ecount[i] = 0;
    if (tid < w) {
        s_rows[tid] = 0;
        s_hits_to[tid] = 0;
        s_combine_base[tid] = 0;
        a.recv_hits[tid] = 0;  // counted by this call's dispatch_recv
    }
    __syncthreads();
    const uint32_t n = s_n, seq = s_seq;
    for (uint32_t tile = 0; tile < n; tile += blockDim.x) {
        const uint32_t t = tile + tid;
        const bool valid = t < n;
        // The tile's routing in and its copies out, in consecutive words: one thread's k
        // entries at a time would touch a sector per entry and lane, and a single SM takes
        // ~20 us per tile of 1024 tokens that way (2026-12-01).
        // Every load of the tile before any store, so they overlap (a store could alias a
        // later load, which would then wait out the one before). s_idx keeps token t's
        // entries k + 1 words apart: no two lanes of a warp read the same bank below.
        const uint32_t entries = (min(n - tile, blockDim.x)) * k;
        const uint64_t first = uint64_t{tile} * k;
        int32_t v[kMaxCudaTopk];
        float wv[kMaxCudaTopk];
#pragma unroll
        for (uint32_t r = 0; r < kMaxCudaTopk; ++r) {
            const uint32_t i = tid + r * blockDim.x;
            if (r < k && i < entries) {
                // int64 routing (torch's index dtype) is narrowed here rather than by a
                // conversion kernel before the call; a value no int32 holds becomes -2, which
                // the range check below reports.
                if (indices64) {
                    const long long e64 =
                        __ldg(reinterpret_cast<const long long*>(indices64) + first + i);
                    v[r] = e64 >= -1 && e64 <= INT32_MAX ? static_cast<int32_t>(e64) : -2;
                } else {
                    v[r] = __ldg(indices + first + i);
                }
                wv[r] = __ldg(weights + first + i);
            }
        }
        bool bad = false;
        int32_t bad_value = 0;
#pragma unroll
        for (uint32_t r = 0; r < kMaxCudaTopk; ++r) {
            const uint32_t i = tid + r * blockDim.x;
            if (r >= k || i >= entries) continue;
            if (v[r] < -1 || v[r] >= static_cast<int32_t>(ne)) {
                bad = true;
                bad_value = v[r];
                v[r] = -1;
            }
            s_idx[i / k * (k + 1) + i % k] = v[r];
            a.indices[first + i] = v[r];
            a.weights[first + i] = wv[r];
            if (a.remote_mask) a.combine_slot[first + i] = first + i;  // remote ones below
        }
        if (bad)
            record_error(a, DeviceError::kProtocol, DeviceError::kPlan, a.rank, seq,
                         static_cast<uint64_t>(static_cast<int64_t>(bad_value)), ne);
        // Only the warps with tokens in this tile (4 of 16 at a 128-token decode step).
        const uint32_t tile_warps = (min(n - tile, blockDim.x) + 31) / 32;
        for (uint32_t i = tid; i < tile_warps * ne; i += blockDim.x) s_bits[i] = 0;
        __syncthreads();
        if (tile == 0) trace_point(a, kTrPlanRouted);
        int32_t e[kMaxCudaTopk];
        uint64_t mask = 0;
#pragma unroll
        for (uint32_t j = 0; j < kMaxCudaTopk; ++j) {
            e[j] = j < k && valid ? s_idx[tid * (k + 1) + j] : -1;
            if (e[j] >= 0) mask |= 1ull << (static_cast<uint32_t>(e[j]) / nl);
        }
#pragma unroll
        for (uint32_t j = 0; j < kMaxCudaTopk; ++j)
            if (e[j] >= 0) atomicOr(&s_bits[warp * ne + static_cast<uint32_t>(e[j])], 1u << lane);
        for (uint32_t d = 0; d < w; ++d) {
            const uint32_t b = __ballot_sync(0xffffffffu, (mask >> d) & 1u);
            if (lane == 0) s_rbits[warp * w + d] = b;
        }
        __syncthreads();
        // Prefix over the warps, per expert and per destination: the masks loaded first (a
        // store between would make each load wait for it), one thread per expert or rank.
        for (uint32_t i = tid; i < ne + w; i += blockDim.x) {
            const bool dest = i >= ne;
            const uint32_t stride = dest ? w : ne, col = dest ? i - ne : i;
            const uint32_t* bits = dest ? s_rbits : s_bits;
            uint32_t* pre = dest ? s_rpre : s_pre;
            uint32_t c[kPlanWarps];
#pragma unroll
            for (uint32_t v = 0; v < kPlanWarps; ++v)
                c[v] = v < tile_warps ? __popc(bits[v * stride + col]) : 0u;
            uint32_t run = dest ? s_rows[col] : s_ecount[col];
#pragma unroll
            for (uint32_t v = 0; v < kPlanWarps; ++v) {
                if (v < tile_warps) pre[v * stride + col] = run;
                run += c[v];
            }
            if (dest)
                s_rows[col] = run;
            else
                s_ecount[col] = run;
        }
        __syncthreads();
        if (tile == 0) trace_point(a, kTrPlanRanked);
        if (valid) {
            const uint32_t lt = lanemask_lt(lane);
            // Places go back over this thread's own routing words, then out in one copy.
#pragma unroll
            for (uint32_t j = 0; j < kMaxCudaTopk; ++j) {
                if (j >= k) continue;
                uint32_t place = 0;
                if (e[j] >= 0) {
                    const uint32_t i = warp * ne + static_cast<uint32_t>(e[j]);
                    place = s_pre[i] + __popc(s_bits[i] & lt);
                }
                s_idx[tid * (k + 1) + j] = static_cast<int32_t>(place);
            }
            for (uint64_t m = mask; m; m &= m - 1) {
                const uint32_t d = __ffsll(static_cast<long long>(m)) - 1;
                const uint32_t i = warp * w + d;
                a.row_pos[uint64_t{t} * w + d] = s_rpre[i] + __popc(s_rbits[i] & lt);
            }
            a.dest_mask[t] = mask;
        }
        __syncthreads();
        for (uint32_t i = tid; i < entries; i += blockDim.x)
            a.place[first + i] = static_cast<uint32_t>(s_idx[i / k * (k + 1) + i % k]);
        __syncthreads();  // the masks and s_idx are reused by the next tile
    }
    trace_point(a, kTrPlanTiles);
    for (uint32_t i = tid; i < ne; i += blockDim.x) {
        a.expert_counts[i] = s_ecount[i];
        atomicAdd(&s_hits_to[i / nl], s_ecount[i]);
    }
    if (tid < w) a.rows_to[tid] = s_rows[tid];
    __syncthreads();
    if (a.remote_mask && a.combine_per_rank) {
        // One partial per row: remote rank d's come back in the order of our rows to d, at
        // the base we announce; a token reads each rank's at its first choice of that rank.
        if (tid == 0) {
            uint32_t base = 0;
            for (uint32_t d = 0; d < w; ++d) {
                s_combine_base[d] = base;
                base += is_remote(a, d) ? s_rows[d] : 0u;
            }
        }
        __syncthreads();
        for (uint32_t t = tid; t < n; t += blockDim.x) {
            uint64_t seen = 0;
            for (uint32_t j = 0; j < k; ++j) {
                const int32_t e = a.indices[t * k + j];
                if (e < 0) continue;
                const uint32_t d = static_cast<uint32_t>(e) / nl;
                if (is_remote(a, d) && !((seen >> d) & 1u))
                    a.combine_slot[t * k + j] =
                        a.remote_combine + s_combine_base[d] + a.row_pos[uint64_t{t} * w + d];
                seen |= 1ull << d;
            }
        }
        __syncthreads();
    } else if (a.remote_mask) {
        uint32_t remote_base = 0;  // combine rows of remote ranks' results, in rank order
        for (uint32_t d = 0; d < w; ++d)
            if (is_remote(a, d))
                remote_base +=
                    assign_remote_combine_rows(a, d, n, remote_base, scan_tmp, s_combine_base);
        __syncthreads();
    }

    // Every store of the block above is before the barrier that ended it (each path ends in
    // one), so the flag orders them all.
    if (kFused && tid == 0) release_call(a.tickets + kTicketPlan, seq);

    // Counts message to every rank (the CountsFormat words; same-node ranks need no combine
    // base: their results come back into slot token * top-k + k).
    const uint32_t words = a.counts_hits_word + nl;
    for (uint32_t i = tid; i < w * words; i += blockDim.x) {
        uint32_t d = i / words, wi = i % words;
        uint32_t v;
        if (wi == CountsWords::kSeq) {
            v = seq;
        } else if (wi == CountsWords::kConfigHash) {
            v = a.hash32;
        } else if (wi == CountsWords::kCombineBase) {
            v = s_combine_base[d];
        } else if (wi == CountsWords::kHits) {
            v = s_hits_to[d];
        } else if (wi < a.counts_hits_word) {
            v = s_rows[wi - CountsWords::kRowsTo];
        } else {
            v = s_ecount[d * nl + (wi - a.counts_hits_word)];
        }
        *counts_word(a.peers[d], a, a.rank, wi) = v;
    }
    trace_point(a, kTrPlanCounts);
    // One fence per signalling thread after the barrier (signal_add, publish_put) orders the
    // whole block's stores: the barrier makes them the signalling thread's to order.
    __syncthreads();
    if (tid < w) {
        if (!is_remote(a, tid)) {
            signal_add(counter_at(a.peers[tid], a.lay.ctr_counts, a.rank), 1);
        } else {
            publish_put(a, tid, proxy::kCounts, seq,
                        a.lay.counts + uint64_t{a.rank} * a.counts_bytes, a.counts_bytes);
        }
    }
    trace_point(a, kTrPlanEnd);
    return seq;
}

template <uint32_t kTopk>
__global__ void __launch_bounds__(kPlanThreads)
    dispatch_plan_kernel(KernelArgs a, const int32_t* indices, const int64_t* indices64,
                         const float* weights, const uint32_t* num_tokens) {
    plan_block<kTopk, false>(a, indices, indices64, weights, num_tokens);
}

// Piece `piece` of `pieces` of one row, written by one warp; piece 0 writes the header
// (token, call, then per top-k choice the local expert at d or -1 and its place, then the hit
// base) and the scales. Every load (header fields, scales, payload) is issued before the
// first store: a store may alias a later load, which would then wait out the round trip of
// the one before (three round trips per row, 2026-12-01).
__device__ inline void write_row(const KernelArgs& a, uint32_t d, uint64_t slot, uint32_t t,
                                 uint32_t seq, const uint8_t* x, const float* x_scale,
                                 uint32_t lane, uint32_t piece, uint32_t pieces) {
    uint8_t* dst = a.peers[d] + a.lay.dispatch + slot * a.row_bytes;
    const uint32_t k = a.topk, nl = a.local_experts, spt = a.scales_per_token;
    const uint32_t n16 = a.payload_bytes / 16;
    const uint32_t lo = n16 * piece / pieces, hi = n16 * (piece + 1) / pieces;
    const bool head = piece == 0;
    int32_t e = -1;
    uint32_t place = 0, hit_base = 0;
    float weight = 0.0f, sc[2] = {0.0f, 0.0f};
    if (head) {
        if (lane < k) {  // top-k <= kMaxCudaTopk < 32
            e = a.indices[t * k + lane];
            place = a.place[t * k + lane];
            weight = a.weights[t * k + lane];
        }
        // Only ranks on other nodes read the hit base: same-node results go to fixed slots.
        if (lane == 0 && is_remote(a, d)) hit_base = a.hit_base[uint64_t{t} * a.world + d];
#pragma unroll
        for (uint32_t u = 0; u < 2; ++u)
            if (lane + 32 * u < spt) sc[u] = x_scale[uint64_t{t} * spt + lane + 32 * u];
    }
    warp_copy16(reinterpret_cast<int4*>(dst + a.payload_offset) + lo,
                reinterpret_cast<const int4*>(x + uint64_t{t} * a.payload_bytes) + lo, hi - lo,
                lane);
    if (!head) return;
    if (lane == 0) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(t, seq);
        *reinterpret_cast<uint32_t*>(dst + a.hit_base_offset) = hit_base;
    }
    if (lane < k) {
        const bool here = e >= 0 && static_cast<uint32_t>(e) / nl == d;
        reinterpret_cast<int16_t*>(dst + kRowHeaderBytes)[lane] =
            here ? static_cast<int16_t>(static_cast<uint32_t>(e) % nl) : int16_t{-1};
        reinterpret_cast<uint32_t*>(dst + a.place_offset)[lane] = here ? place : 0u;
        reinterpret_cast<float*>(dst + a.weight_offset)[lane] = here ? weight : 0.0f;
    }
    float* so = reinterpret_cast<float*>(dst + a.scale_offset);
#pragma unroll
    for (uint32_t u = 0; u < 2; ++u)
        if (lane + 32 * u < spt) so[lane + 32 * u] = sc[u];
    for (uint32_t i = lane + 64; i < spt; i += 32)  // hidden above 8192
        so[i] = x_scale[uint64_t{t} * spt + i];
}

// Work items are (token, destination) rows, each cut into `pieces` so that a small call still
// gives every warp of the grid a share; warps are numbered across blocks first, so consecutive
// items land on different SMs. `overflow`: the rows past the private slots, else the others.
__device__ inline void send_rows(const KernelArgs& a, const uint8_t* x, const float* x_scale,
                                 uint32_t n, uint32_t seq, bool overflow,
                                 const uint64_t* s_overflow) {
    const uint32_t w = a.world, p = a.private_slots, lane = threadIdx.x & 31u;
    const uint32_t num_warps = gridDim.x * (blockDim.x / 32);
    const uint32_t gw = (threadIdx.x / 32) * gridDim.x + blockIdx.x;
    const uint32_t items = n * w;
    const uint32_t pieces = items == 0 ? 1 : max(1u, min(kMaxRowPieces, num_warps / items));
    for (uint32_t u = gw; u < items * pieces; u += num_warps) {
        const uint32_t item = u / pieces, piece = u % pieces;
        const uint32_t t = item / w, d = item % w;
        // Both loads at once (row_pos of a destination the token skips is never used).
        const uint64_t mask = a.dest_mask[t];
        const uint32_t j = a.row_pos[uint64_t{t} * w + d];
        if (!((mask >> d) & 1u)) continue;
        if (!overflow && j < p)
            write_row(a, d, uint64_t{a.rank} * p + j, t, seq, x, x_scale, lane, piece, pieces);
        else if (overflow && j >= p)
            write_row(a, d, s_overflow[d] + (j - p), t, seq, x, x_scale, lane, piece, pieces);
    }
}

// The send after the plan: private rows, every peer's counts, overflow rows, signals.
__device__ __forceinline__ void send_after_plan(const KernelArgs& a, const uint8_t* x,
                                                const float* x_scale, uint32_t seq, uint32_t n) {
    __shared__ uint64_t s_overflow[kMaxCudaWorld];
    __shared__ int s_ok;
    const uint32_t tid = threadIdx.x, w = a.world, p = a.private_slots;
    trace_point(a, kTrSendBegin);
    let_receiver_start(a);
    send_rows(a, x, x_scale, n, seq, false, nullptr);
    // Remote ranks' private rows leave before any count is known, as they do over NVLink.
    if (a.remote_mask && last_block_of_call(a, kTicketPrivate, seq) && tid < w && is_remote(a, tid))
        publish_put(a, tid, proxy::kPrivate, seq,
                    a.lay.dispatch + uint64_t{a.rank} * p * a.row_bytes,
                    uint64_t{min(a.rows_to[tid], p)} * a.row_bytes);

    // Every peer's counts: the rows each sender sends to each rank fix the overflow offsets.
    // Remote peers' through one polling block, which copies their messages into the mirror.
    if (tid == 0) s_ok = 1;
    __syncthreads();
    if (tid < w && !is_remote(a, tid) &&
        !wait_counter(a, counter_at(a.self, a.lay.ctr_counts, tid), seq,
                      DeviceError::kSendWaitCounts, tid, seq))
        s_ok = 0;
    if (a.remote_mask) {
        const uint32_t words = a.counts_bytes / 4;
        const bool ok = wait_remote_counters(
            a, kTicketCountsPoll, kTicketCountsRelay, a.lay.ctr_counts, seq,
            DeviceError::kSendWaitCounts, seq, [&] {
                for (uint32_t i = tid; i < w * words; i += blockDim.x)
                    if (is_remote(a, i / words))
                        reinterpret_cast<uint32_t*>(a.counts_mirror)[i] =
                            ld_peer_u32(counts_word(a.inbox, a, i / words, i % words), true);
            });
        if (!ok && tid == 0) s_ok = 0;
    }
    __syncthreads();
    if (s_ok && tid < w) {
        const uint32_t their_hash = counts_in(a, tid, CountsWords::kConfigHash);
        const uint32_t their_seq = counts_in(a, tid, CountsWords::kSeq);
        if (their_hash != a.hash32) {
            record_error(a, DeviceError::kConfig, DeviceError::kSendWaitCounts, tid, seq,
                         their_hash, a.hash32);
            s_ok = 0;
        } else if (their_seq != seq) {
            record_error(a, DeviceError::kProtocol, DeviceError::kSendWaitCounts, tid, seq,
                         their_seq, seq);
            s_ok = 0;
        }
    }
    __syncthreads();
    trace_point(a, kTrSendCountsIn);
    if (tid < w) {
        const uint32_t d = tid;
        uint64_t at = uint64_t{w} * p;
        for (uint32_t s = 0; s < a.rank; ++s) {
            // min: keeps every write inside the region, even on bad counts.
            const uint32_t r = min(counts_in(a, s, CountsWords::kRowsTo + d), a.max_tokens);
            at += r > p ? r - p : 0;
        }
        s_overflow[d] = at;
    }
    __syncthreads();
    if (s_ok) send_rows(a, x, x_scale, n, seq, true, s_overflow);
    __syncthreads();  // signal_add's fence then covers every warp's rows (see the plan kernel)
    // Without every count the overflow rows were not written: no arrival, so receivers time
    // out naming this rank instead of reading rows that are not there.
    if (s_ok && tid < w && !is_remote(a, tid))
        signal_add(counter_at(a.peers[tid], a.lay.ctr_dispatch, a.rank), 1);
    if (a.remote_mask && last_block_of_call(a, kTicketDispatch, seq) && tid < w &&
        is_remote(a, tid)) {
        const uint32_t r = a.rows_to[tid];
        const uint64_t rows = s_ok && r > p ? r - p : 0;
        publish_put(a, tid, proxy::kOverflow, seq, a.lay.dispatch + s_overflow[tid] * a.row_bytes,
                    rows * a.row_bytes);
    }
    trace_point(a, kTrSendEnd);
}

__global__ void dispatch_send_kernel(KernelArgs a, const uint8_t* x, const float* x_scale) {
    // Written by the plan kernel earlier on this stream.
    send_after_plan(a, x, x_scale, static_cast<uint32_t>(a.state->seq), a.state->num_tokens);
}

// The plan fused into the send (KernelArgs::fused_plan): block 0 plans the call first, the
// other blocks wait until it is done; no plan kernel, so no kernel boundary before the send
// (3.2 us at 128 tokens, 2026-12-01). The grid fits on the GPU at once (see create()), so
// block 0 always runs. kTopk as for dispatch_plan_kernel.
template <uint32_t kTopk>
__global__ void __launch_bounds__(kPlanThreads)
    dispatch_plan_send_kernel(KernelArgs a, const uint8_t* x, const float* x_scale,
                              const int32_t* indices, const int64_t* indices64,
                              const float* weights, const uint32_t* num_tokens) {
    __shared__ uint32_t s_call;
    uint32_t seq;
    if (blockIdx.x == 0) {
        seq = plan_block<kTopk, true>(a, indices, indices64, weights, num_tokens);
    } else {
        // The call number from the blocks that entered before (every call launches this
        // grid once): block 0 bumps state->seq, perhaps before this block would read it.
        if (threadIdx.x == 0) {
            const unsigned long long before = atomicAdd(&a.tickets[kTicketSendEntry], 1ull);
            s_call = static_cast<uint32_t>(before / (gridDim.x - 1) + 1);
            if (!wait_counter(a, reinterpret_cast<const uint64_t*>(a.tickets + kTicketPlan), s_call,
                              DeviceError::kPlan, a.rank, s_call))
                s_call = 0;
        }
        __syncthreads();
        seq = s_call;
        if (seq == 0) return;  // recorded; receivers time out naming this rank
    }
    send_after_plan(a, x, x_scale, seq, __ldcg(&a.state->num_tokens));
}

__device__ __forceinline__ uint32_t align_up(uint32_t v, uint32_t al) {
    return (v + al - 1) / al * al;
}

// Every block derives the grouped layout from the counts messages (group offsets, where each
// sender's rows start in each group, where its overflow rows are), writes the metadata and
// zero padding of some groups, then its warps take received rows one each and copy a row to
// every place its header names: offsets[e] + (hits of e from senders before s) + place. That
// is the CPU backend's order (senders in rank order, a sender's rows in its order), so both
// backends produce byte-identical batches from the same inputs.
__global__ void __launch_bounds__(kRecvThreads)
    dispatch_recv_kernel(KernelArgs a, uint8_t* out_x, float* out_scale, uint32_t* out_counts,
                         uint32_t* out_offsets, RowSource* out_sources, uint32_t capacity) {
    using Scan = cub::BlockScan<uint32_t, kRecvThreads>;
    __shared__ typename Scan::TempStorage scan_tmp;
    __shared__ int s_ok;
    extern __shared__ uint32_t recv_smem[];
    const uint32_t tid = threadIdx.x, lane = tid & 31u;
    const uint32_t w = a.world, nl = a.local_experts, k = a.topk, p = a.private_slots;
    const uint32_t seq = static_cast<uint32_t>(a.state->seq);
    uint32_t* s_before = recv_smem;         // [expert][sender] hits of earlier senders
    uint32_t* s_total = s_before + nl * w;  // [expert] hits of all senders
    uint32_t* s_off = s_total + nl;         // [expert + 1] group offsets, padding included
    uint32_t* s_start = s_off + nl + 1;     // [sender + 1] first row of each sender
    uint32_t* s_ovf = s_start + w + 1;      // [sender] where its overflow rows begin
    uint32_t* s_got = s_ovf + w;            // [sender] hits this block placed
    // [sender + 1] where each remote sender's run starts in combine_inv (remote senders' hits
    // back to back in rank order; combine_send derives the same from the same counts words)
    uint32_t* s_rstart = s_got + w;
    trace_point(a, kTrRecvBegin);
    // The layout, from the counts messages, before waiting for the rows, so this work overlaps
    // the peers' sends. The counts are in once this rank's dispatch_send is past its wait for
    // them (remote ones copied into the mirror); this kernel may start before that (early
    // launch), hence the waits, which cost a load each when they are in.
    if (tid == 0) s_ok = 1;
    __syncthreads();
    if (tid < w) {
        const bool relayed = is_remote(a, tid);
        const uint64_t* ctr =
            relayed ? reinterpret_cast<const uint64_t*>(a.tickets + kTicketCountsRelay)
                    : counter_at(a.self, a.lay.ctr_counts, tid);
        if (!wait_counter(a, ctr, seq, DeviceError::kSendWaitCounts, tid, seq, relayed)) s_ok = 0;
    }
    __syncthreads();
    if (!s_ok) {
        finish_after_sender();
        return;
    }
    const uint32_t hw = a.counts_hits_word;
    for (uint32_t e = tid; e < nl; e += blockDim.x) {
        uint32_t tot = 0;
        for (uint32_t s = 0; s < w; ++s) {
            s_before[e * w + s] = tot;
            tot += counts_in(a, s, hw + e);
        }
        s_total[e] = tot;
    }
    if (tid < w) s_ovf[tid] = min(counts_in(a, tid, CountsWords::kRowsTo + a.rank), a.max_tokens);
    __syncthreads();
    if (tid == 0) {
        uint32_t rows = 0, ob = w * p, rrun = 0;
        for (uint32_t s = 0; s < w; ++s) {
            const uint32_t r = s_ovf[s];
            s_start[s] = rows;
            rows += r;
            s_ovf[s] = ob;
            ob += r > p ? r - p : 0;
            s_rstart[s] = rrun;
            if (a.combine_inv && is_remote(a, s)) rrun += counts_in(a, s, CountsWords::kHits);
        }
        s_start[w] = rows;
        s_rstart[w] = rrun;
    }
    uint32_t carry = 0;
    for (uint32_t base = 0; base < nl; base += blockDim.x) {
        const uint32_t e = base + tid;
        const uint32_t v = e < nl ? align_up(s_total[e], a.alignment) : 0u;
        uint32_t pre, agg;
        Scan(scan_tmp).ExclusiveSum(v, pre, agg);
        if (e < nl) s_off[e] = carry + pre;
        carry += agg;
        __syncthreads();  // scan_tmp is reused
    }
    if (tid == 0) s_off[nl] = carry;
    __syncthreads();

    // Metadata and zero padding (a grouped GEMM reads whole groups), groups over blocks.
    const uint32_t pb16 = a.payload_bytes / 16, spt = a.scales_per_token;
    for (uint32_t e = blockIdx.x; e < nl; e += gridDim.x) {
        const uint32_t offset = s_off[e], total = s_total[e], end = s_off[e + 1];
        if (tid == 0) {
            out_counts[e] = total;
            out_offsets[e] = offset;
        }
        for (uint32_t o = offset + total; o < end && o < a.max_rows; ++o) {
            // Slabs: the group's padding rows are the slab's rows total.., inside it.
            const uint32_t in_group = o - offset;
            if (!capacity || in_group < capacity) {
                const uint64_t po = capacity ? uint64_t{e} * capacity + in_group : o;
                int4* dst = reinterpret_cast<int4*>(out_x + po * a.payload_bytes);
                for (uint32_t i = tid; i < pb16; i += blockDim.x) dst[i] = make_int4(0, 0, 0, 0);
                for (uint32_t i = tid; i < spt; i += blockDim.x) out_scale[po * spt + i] = 0;
            }
            if (tid == 0) {
                a.row_src[o] = RowSource{};
                if (out_sources) out_sources[o] = RowSource{};
            }
        }
    }
    if (blockIdx.x == 0 && tid == 0) {
        out_offsets[nl] = s_off[nl];
        a.state->out_rows = s_off[nl];
        a.state->out_capacity = capacity;
    }
    if (a.combine_per_rank && blockIdx.x == 0 && tid <= w) a.recv_start[tid] = s_start[tid];

    if (tid < w) s_got[tid] = 0;
    const uint64_t want_rows = uint64_t{seq} * a.dispatch_send_blocks;
    if (tid < w && !is_remote(a, tid) &&
        !wait_counter(a, counter_at(a.self, a.lay.ctr_dispatch, tid), want_rows,
                      DeviceError::kRecvWaitRows, tid, seq))
        s_ok = 0;
    if (a.remote_mask &&
        !wait_remote_counters(a, kTicketDispatchPoll, kTicketDispatchRelay, a.lay.ctr_dispatch,
                              want_rows, DeviceError::kRecvWaitRows, seq, [] {}) &&
        tid == 0)
        s_ok = 0;
    __syncthreads();
    trace_point(a, kTrRecvRowsIn);
    if (!s_ok) {
        finish_after_sender();
        return;
    }

    // Rows, a warp each; warps numbered across blocks first.
    const uint32_t num_warps = gridDim.x * (blockDim.x / 32);
    const uint32_t gw = (tid / 32) * gridDim.x + blockIdx.x;
    const uint32_t rows = s_start[w];
    for (uint32_t g = gw; g < rows; g += num_warps) {
        uint32_t s = 0;
        while (g >= s_start[s + 1]) ++s;
        const uint32_t i = g - s_start[s];
        const bool remote = is_remote(a, s);
        const uint64_t ri = i < p ? uint64_t{s} * p + i : uint64_t{s_ovf[s]} + (i - p);
        const uint8_t* row = from(a, s) + a.lay.dispatch + ri * a.row_bytes;
        // The whole header in one round of loads (lane j reads choice j's expert and place),
        // together with the payload's first round and the scales: the checks below wait for
        // the header, the copy then for nothing more (a round trip per row saved).
        const int4* src16 = reinterpret_cast<const int4*>(row + a.payload_offset);
        const float* ssrc = reinterpret_cast<const float*>(row + a.scale_offset);
        int4 v[8];
#pragma unroll
        for (uint32_t u = 0; u < 8; ++u)
            if (lane + 32 * u < pb16) v[u] = ld_peer(src16 + lane + 32 * u, remote);
        float sv[2] = {0.0f, 0.0f};
#pragma unroll
        for (uint32_t u = 0; u < 2; ++u)
            if (lane + 32 * u < spt) sv[u] = ld_peer(ssrc + lane + 32 * u, remote);
        const uint2 head = ld_peer(reinterpret_cast<const uint2*>(row), remote);
        const uint32_t hit_base = ld_peer_u32(row + a.hit_base_offset, remote);
        int32_t id = -1;
        uint32_t place = 0;
        if (lane < k) {
            id = ld_peer(reinterpret_cast<const short*>(row + kRowHeaderBytes) + lane, remote);
            place = ld_peer_u32(row + a.place_offset + 4 * lane, remote);
        }
        const uint32_t token = head.x;
        if (head.y != seq || token >= a.max_tokens) {
            if (lane == 0)
                record_error(a, DeviceError::kProtocol, DeviceError::kRecvRows, s, seq,
                             (uint64_t{head.y} << 32) | token, seq);
            continue;
        }
        // o: the grouped row (the numbering of offsets, sources and the combine's
        // bookkeeping); po: where the row goes in out_x, the same unless writing slabs.
        uint32_t o = 0, po = 0, in_group = 0;
        bool bad = false;
        if (id >= 0) {
            const uint32_t e = static_cast<uint32_t>(id);
            if (e >= nl) {
                bad = true;
            } else {
                const uint32_t before = s_before[e * w + s];
                const uint32_t hits = (s + 1 < w ? s_before[e * w + s + 1] : s_total[e]) - before;
                in_group = before + place;
                o = s_off[e] + in_group;
                po = capacity ? e * capacity + in_group : o;
                bad = place >= hits || o >= a.max_rows;
            }
        }
        const uint32_t bad_lanes = __ballot_sync(0xffffffffu, bad);
        if (bad_lanes) {
            if (lane == __ffs(bad_lanes) - 1)
                record_error(a, DeviceError::kProtocol, DeviceError::kRecvRows, s, seq,
                             (uint64_t{static_cast<uint32_t>(id)} << 32) | place, nl);
            continue;
        }
        const uint32_t full_lanes = __ballot_sync(0xffffffffu, capacity && in_group >= capacity);
        if (full_lanes) {
            if (lane == __ffs(full_lanes) - 1)
                record_error(a, DeviceError::kCapacity, DeviceError::kRecvRows, s, seq, in_group,
                             capacity);
            continue;
        }
        const uint32_t hm = __ballot_sync(0xffffffffu, id >= 0);
        if (a.combine_per_rank) {
            // What combine_send needs to sum this row's results: each choice's batch row and
            // weight, and the token.
            if (lane < k) {
                a.recv_o[uint64_t{g} * k + lane] = id >= 0 ? o : ~0u;
                a.recv_w[uint64_t{g} * k + lane] =
                    ld_peer(reinterpret_cast<const float*>(row + a.weight_offset) + lane, remote);
            }
            if (lane == 0) a.recv_token[g] = token;
        }
        if (id >= 0) {
            const RowSource meta{s, token, lane};
            a.row_src[o] = meta;
            if (capacity) a.out_row[o] = po;
            if (out_sources) out_sources[o] = meta;
            if (remote) {
                const uint32_t pos = hit_base + __popc(hm & lanemask_lt(lane));
                a.combine_pos[o] = pos;
                // A position past the announced hits is caught by combine_send's checks.
                const uint64_t at = uint64_t{s_rstart[s]} + pos;
                if (a.combine_inv && at < s_rstart[s + 1] && at < a.max_rows) a.combine_inv[at] = o;
            }
        }
        // The payload read once, written to every place, eight vectors per lane at a time.
        // Loop bounds are the same in every lane: the shuffles need the whole warp.
        for (uint32_t c0 = 0; c0 < pb16; c0 += 8 * 32) {
            const uint32_t c = c0 + lane;
            if (c0 != 0) {
#pragma unroll
                for (uint32_t u = 0; u < 8; ++u)
                    if (c + 32 * u < pb16) v[u] = ld_peer(src16 + c + 32 * u, remote);
            }
            for (uint32_t m = hm; m; m &= m - 1) {
                const uint32_t oh = __shfl_sync(0xffffffffu, po, __ffs(m) - 1);
                int4* dst = reinterpret_cast<int4*>(out_x + uint64_t{oh} * a.payload_bytes);
#pragma unroll
                for (uint32_t u = 0; u < 8; ++u)
                    if (c + 32 * u < pb16) dst[c + 32 * u] = v[u];
            }
        }
        for (uint32_t c0 = 0; c0 < spt; c0 += 32) {
            const uint32_t c = c0 + lane;
            const float sc = c0 == 0    ? sv[0]
                             : c0 == 32 ? sv[1]
                             : c < spt  ? ld_peer(ssrc + c, remote)
                                        : 0.0f;
            for (uint32_t m = hm; m; m &= m - 1) {
                const uint32_t oh = __shfl_sync(0xffffffffu, po, __ffs(m) - 1);
                if (c < spt) out_scale[uint64_t{oh} * spt + c] = sc;
            }
        }
        if (lane == 0) atomicAdd(&s_got[s], __popc(hm));
    }

    // Every hit a sender announced was placed (a lost or repeated row shows here).
    __syncthreads();
    if (tid < w) atomicAdd(&a.recv_hits[tid], s_got[tid]);
    if (last_block_of_call(a, kTicketRecv, seq) && tid < w) {
        const uint32_t want = counts_in(a, tid, CountsWords::kHits);
        const uint32_t got = __ldcg(&a.recv_hits[tid]);
        if (got != want)
            record_error(a, DeviceError::kProtocol, DeviceError::kRecvRows, tid, seq, got, want);
    }
    trace_point(a, kTrRecvEnd);
    finish_after_sender();
}

}  // namespace

uint32_t dispatch_plan_smem(uint32_t num_experts, uint32_t world, uint32_t topk) {
    return sizeof(uint32_t) * (2 * kPlanWarps * num_experts + num_experts + 2 * kPlanWarps * world +
                               world + kPlanThreads * (topk + 1));
}

uint32_t dispatch_recv_smem(uint32_t num_experts, uint32_t world) {
    const uint32_t nl = num_experts / world;
    return sizeof(uint32_t) * (num_experts + nl + nl + 1 + 4 * world + 2);
}

cudaError_t set_dispatch_smem(uint32_t plan_bytes, uint32_t recv_bytes) {
    const int pb = static_cast<int>(plan_bytes);
    const auto attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
    cudaError_t e = cudaFuncSetAttribute(dispatch_plan_kernel<0>, attr, pb);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(dispatch_plan_kernel<8>, attr, pb);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(dispatch_plan_send_kernel<0>, attr, pb);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(dispatch_plan_send_kernel<8>, attr, pb);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(dispatch_recv_kernel, attr, static_cast<int>(recv_bytes));
    return e;
}

bool dispatch_send_fuses_plan(uint32_t send_threads) { return send_threads == kPlanThreads; }

cudaError_t launch_dispatch_send(const KernelArgs& a, const void* x, const float* x_scale,
                                 const int32_t* indices, const int64_t* indices64,
                                 const float* weights, const uint32_t* num_tokens,
                                 uint32_t send_blocks, uint32_t send_threads, cudaStream_t stream) {
    const auto* xb = static_cast<const uint8_t*>(x);
    if (a.fused_plan) {
        auto* kernel = a.topk == 8 ? dispatch_plan_send_kernel<8> : dispatch_plan_send_kernel<0>;
        kernel<<<send_blocks, kPlanThreads, a.plan_smem, stream>>>(a, xb, x_scale, indices,
                                                                   indices64, weights, num_tokens);
        return cudaGetLastError();
    }
    if (a.topk == 8)
        dispatch_plan_kernel<8>
            <<<1, kPlanThreads, a.plan_smem, stream>>>(a, indices, indices64, weights, num_tokens);
    else
        dispatch_plan_kernel<0>
            <<<1, kPlanThreads, a.plan_smem, stream>>>(a, indices, indices64, weights, num_tokens);
    FERRY_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    dispatch_send_kernel<<<send_blocks, send_threads, 0, stream>>>(a, xb, x_scale);
    return cudaGetLastError();
}

cudaError_t launch_dispatch_recv(const KernelArgs& a, void* x, float* x_scale, uint32_t* counts,
                                 uint32_t* offsets, RowSource* sources, uint32_t capacity,
                                 cudaStream_t stream) {
    return launch_after(a.early_launch != 0, dispatch_recv_kernel, a.dispatch_recv_blocks,
                        kRecvThreads, a.recv_smem, stream, a, static_cast<uint8_t*>(x), x_scale,
                        counts, offsets, sources, capacity);
}

cudaError_t preload_dispatch_kernels() {
    cudaFuncAttributes attr;
    cudaError_t e = cudaFuncGetAttributes(&attr, dispatch_plan_kernel<0>);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, dispatch_plan_kernel<8>);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, dispatch_send_kernel);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, dispatch_plan_send_kernel<0>);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, dispatch_plan_send_kernel<8>);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, dispatch_recv_kernel);
    return e;
}

}  // namespace ferry::moe::cuda
