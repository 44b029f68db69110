// Dispatch kernels: plan (counts per expert and destination, counts messages to every peer),
// send (rows straight into peers' private slots, then, once every peer's counts are here, the
// rest into the overflow run at the offset all ranks derive from the counts matrix), and
// recv (rows grouped per local expert, in the order the CPU backend produces).
#include <cub/block/block_scan.cuh>

#include "moe/cuda/device_common.cuh"
#include "moe/cuda/kernels.h"

namespace ferry::moe::cuda {
namespace {

constexpr uint32_t kPlanThreads = 1024;
constexpr uint32_t kRecvThreads = 256;

using PlanScan = cub::BlockScan<uint32_t, kPlanThreads>;

// Remote rank d sends our tokens' results back as one compact run (the CPU backend's order:
// token order, a token's hits in top-k order) starting at the base we announce in the counts
// message; combine_slot tells combine_recv where each (token, k) landed. Returns the hits to d.
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
            uint32_t at = a.remote_combine + base + carry + pre;
            for (uint32_t j = 0; j < k; ++j) {
                const int32_t e = a.indices[t * k + j];
                if (e >= 0 && static_cast<uint32_t>(e) / nl == d) a.combine_slot[t * k + j] = at++;
            }
        }
        carry += agg;
        __syncthreads();  // scan_tmp is reused
    }
    if (tid == 0) s_combine_base[d] = base;
    return carry;
}

// Single block: one call's routing is at most max_tokens * top-k entries, and a block-wide
// scan per destination gives every token its row at that destination in token order.
__global__ void __launch_bounds__(kPlanThreads)
    dispatch_plan_kernel(KernelArgs a, const int32_t* indices, const float* weights,
                         const uint32_t* num_tokens) {
    using Scan = PlanScan;
    __shared__ typename Scan::TempStorage scan_tmp;
    __shared__ uint32_t s_seq, s_n;
    __shared__ uint32_t s_rows_to[kMaxCudaWorld], s_hits_to[kMaxCudaWorld],
        s_combine_base[kMaxCudaWorld];
    const uint32_t tid = threadIdx.x, w = a.world, k = a.topk, nl = a.local_experts;
    if (tid == 0) {
        uint64_t seq = a.state->seq + 1;
        a.state->seq = seq;
        uint32_t n = *num_tokens;
        if (n > a.max_tokens) {
            record_error(a, DeviceError::kTooMany, DeviceError::kPlan, a.rank,
                         static_cast<uint32_t>(seq), n, a.max_tokens);
            n = 0;
        }
        a.state->num_tokens = n;
        s_seq = static_cast<uint32_t>(seq);
        s_n = n;
    }
    for (uint32_t i = tid; i < a.num_experts; i += blockDim.x) a.expert_counts[i] = 0;
    if (tid < w) {
        s_hits_to[tid] = 0;
        s_combine_base[tid] = 0;
    }
    __syncthreads();
    const uint32_t n = s_n, seq = s_seq;
    for (uint32_t t = tid; t < n; t += blockDim.x) {
        uint64_t mask = 0;
        for (uint32_t j = 0; j < k; ++j) {
            int32_t e = indices[t * k + j];
            if (e < -1 || e >= static_cast<int32_t>(a.num_experts)) {
                record_error(a, DeviceError::kProtocol, DeviceError::kPlan, a.rank, seq,
                             static_cast<uint64_t>(static_cast<int64_t>(e)), a.num_experts);
                e = -1;
            }
            a.indices[t * k + j] = e;
            a.weights[t * k + j] = weights[t * k + j];
            if (a.remote_mask) a.combine_slot[t * k + j] = t * k + j;  // remote ones below
            if (e < 0) continue;
            mask |= 1ull << (static_cast<uint32_t>(e) / nl);
            atomicAdd(&a.expert_counts[e], 1u);
        }
        a.dest_mask[t] = mask;
    }
    __syncthreads();
    uint32_t remote_base = 0;  // combine rows of remote ranks' results, in rank order
    for (uint32_t d = 0; d < w; ++d) {
        uint32_t carry = 0;
        for (uint32_t base = 0; base < n; base += blockDim.x) {
            uint32_t t = base + tid;
            uint32_t flag = t < n ? static_cast<uint32_t>((a.dest_mask[t] >> d) & 1u) : 0u;
            uint32_t pre, agg;
            Scan(scan_tmp).ExclusiveSum(flag, pre, agg);
            if (t < n) a.row_pos[uint64_t{t} * w + d] = carry + pre;
            carry += agg;
            __syncthreads();  // scan_tmp is reused
        }
        if (tid == 0) {
            s_rows_to[d] = carry;
            a.rows_to[d] = carry;
        }
        if (is_remote(a, d))
            remote_base +=
                assign_remote_combine_rows(a, d, n, remote_base, scan_tmp, s_combine_base);
    }
    // Hits per destination: one thread per expert (a loop over a destination's experts in one
    // thread was a chain of L2 round trips, 128 at EP2).
    for (uint32_t i = tid; i < a.num_experts; i += blockDim.x)
        atomicAdd(&s_hits_to[i / nl], a.expert_counts[i]);
    __syncthreads();

    // Counts message to every rank (the CountsFormat words; no combine base: results come
    // back into slot token * top-k + k).
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
            v = s_rows_to[wi - CountsWords::kRowsTo];
        } else {
            v = a.expert_counts[d * nl + (wi - a.counts_hits_word)];
        }
        *counts_word(a.peers[d], a, a.rank, wi) = v;
    }
    __threadfence_system();
    __syncthreads();
    if (tid < w) {
        if (!is_remote(a, tid)) {
            signal_add(counter_at(a.peers[tid], a.lay.ctr_counts, a.rank), 1);
        } else {
            publish_put(a, tid, proxy::kCounts, seq,
                        a.lay.counts + uint64_t{a.rank} * a.counts_bytes, a.counts_bytes);
        }
    }
}

// One row, written by one warp: header (token, call, local expert per top-k or -1), payload,
// scales.
__device__ inline void write_row(const KernelArgs& a, uint32_t d, uint64_t slot, uint32_t t,
                                 uint32_t seq, const uint8_t* x, const float* x_scale,
                                 uint32_t lane) {
    uint8_t* dst = a.peers[d] + a.lay.dispatch + slot * a.row_bytes;
    const uint32_t k = a.topk, nl = a.local_experts;
    if (lane == 0) *reinterpret_cast<uint2*>(dst) = make_uint2(t, seq);
    for (uint32_t j = lane; j < k; j += 32) {
        int32_t e = a.indices[t * k + j];
        bool here = e >= 0 && static_cast<uint32_t>(e) / nl == d;
        reinterpret_cast<int16_t*>(dst + kRowHeaderBytes)[j] =
            here ? static_cast<int16_t>(static_cast<uint32_t>(e) % nl) : int16_t{-1};
    }
    warp_copy16(reinterpret_cast<int4*>(dst + a.payload_offset),
                reinterpret_cast<const int4*>(x + uint64_t{t} * a.payload_bytes),
                a.payload_bytes / 16, lane);
    float* so = reinterpret_cast<float*>(dst + a.scale_offset);
    for (uint32_t i = lane; i < a.scales_per_token; i += 32)
        so[i] = x_scale[uint64_t{t} * a.scales_per_token + i];
}

// Tokens go to warps grid-stride; a warp writes its token's rows to every destination.
__global__ void dispatch_send_kernel(KernelArgs a, const uint8_t* x, const float* x_scale) {
    __shared__ uint64_t s_overflow[kMaxCudaWorld];
    __shared__ int s_ok;
    const uint32_t tid = threadIdx.x, w = a.world, p = a.private_slots;
    const uint32_t lane = tid & 31u, warps = blockDim.x / 32;
    const uint32_t warp = blockIdx.x * warps + tid / 32, num_warps = gridDim.x * warps;
    // Written by the plan kernel earlier on this stream.
    const uint32_t seq = static_cast<uint32_t>(a.state->seq), n = a.state->num_tokens;
    for (uint32_t t = warp; t < n; t += num_warps) {
        for (uint64_t mask = a.dest_mask[t]; mask; mask &= mask - 1) {
            uint32_t d = __ffsll(static_cast<long long>(mask)) - 1;
            uint32_t j = a.row_pos[uint64_t{t} * w + d];
            if (j < p) write_row(a, d, uint64_t{a.rank} * p + j, t, seq, x, x_scale, lane);
        }
    }
    // Remote ranks' private rows leave before any count is known, as they do over NVLink.
    if (a.remote_mask && last_block_of_call(a, kTicketPrivate, seq) && tid < w && is_remote(a, tid))
        publish_put(a, tid, proxy::kPrivate, seq,
                    a.lay.dispatch + uint64_t{a.rank} * p * a.row_bytes,
                    uint64_t{min(a.rows_to[tid], p)} * a.row_bytes);

    // Every peer's counts: the rows each sender sends to each rank fix the overflow offsets.
    if (tid == 0) s_ok = 1;
    __syncthreads();
    if (tid < w) {
        uint8_t* src = from(a, tid);
        const bool host = is_remote(a, tid);
        bool ok = wait_counter(a, counter_at(src, a.lay.ctr_counts, tid), seq,
                               DeviceError::kSendWaitCounts, tid, seq);
        if (ok) {
            uint32_t their_hash =
                ld_peer_u32(counts_word(src, a, tid, CountsWords::kConfigHash), host);
            uint32_t their_seq = ld_peer_u32(counts_word(src, a, tid, CountsWords::kSeq), host);
            if (their_hash != a.hash32) {
                record_error(a, DeviceError::kConfig, DeviceError::kSendWaitCounts, tid, seq,
                             their_hash, a.hash32);
                ok = false;
            } else if (their_seq != seq) {
                record_error(a, DeviceError::kProtocol, DeviceError::kSendWaitCounts, tid, seq,
                             their_seq, seq);
                ok = false;
            }
        }
        if (!ok) s_ok = 0;
    }
    __syncthreads();
    if (tid < w) {
        const uint32_t d = tid;
        uint64_t at = uint64_t{w} * p;
        for (uint32_t s = 0; s < a.rank; ++s) {
            uint32_t r = ld_peer_u32(counts_word(from(a, s), a, s, CountsWords::kRowsTo + d),
                                     is_remote(a, s));
            r = min(r, a.max_tokens);  // keeps every write inside the region, even on bad counts
            at += r > p ? r - p : 0;
        }
        s_overflow[d] = at;
    }
    __syncthreads();
    if (s_ok) {
        for (uint32_t t = warp; t < n; t += num_warps) {
            for (uint64_t mask = a.dest_mask[t]; mask; mask &= mask - 1) {
                uint32_t d = __ffsll(static_cast<long long>(mask)) - 1;
                uint32_t j = a.row_pos[uint64_t{t} * w + d];
                if (j >= p) write_row(a, d, s_overflow[d] + (j - p), t, seq, x, x_scale, lane);
            }
        }
    }
    __threadfence_system();
    __syncthreads();
    if (tid < w && !is_remote(a, tid))
        signal_add(counter_at(a.peers[tid], a.lay.ctr_dispatch, a.rank), 1);
    if (a.remote_mask && last_block_of_call(a, kTicketDispatch, seq) && tid < w &&
        is_remote(a, tid)) {
        const uint32_t r = a.rows_to[tid];
        const uint64_t rows = s_ok && r > p ? r - p : 0;
        publish_put(a, tid, proxy::kOverflow, seq, a.lay.dispatch + s_overflow[tid] * a.row_bytes,
                    rows * a.row_bytes);
    }
}

__device__ __forceinline__ uint32_t align_up(uint32_t v, uint32_t al) {
    return (v + al - 1) / al * al;
}

// Block (e, s): the rows sender s sent here that chose local expert e, in the sender's row
// order, at offsets[e] + (hits of e from senders before s). That is the CPU backend's order,
// so both backends produce byte-identical batches from the same inputs.
// The grid may be smaller than (local experts x senders): ranks sharing a GPU each get a part
// of it, since every rank's waiting blocks must be resident at once (see create()).
struct RecvShared {
    typename cub::BlockScan<uint32_t, kRecvThreads>::TempStorage scan_tmp;
    int ok;
    uint32_t offset, total, before, rows_from, hits;
    uint64_t overflow_begin;
    uint64_t row[kRecvThreads];
    uint32_t tok[kRecvThreads], k[kRecvThreads];
    uint32_t pos[kRecvThreads];  // remote senders: the row's place among their hits here
};

__device__ void dispatch_recv_pair(const KernelArgs& a, uint32_t e, uint32_t s, RecvShared& sh,
                                   uint8_t* out_x, float* out_scale, uint32_t* out_counts,
                                   uint32_t* out_offsets, RowSource* out_sources) {
    using Scan = cub::BlockScan<uint32_t, kRecvThreads>;
    auto& scan_tmp = sh.scan_tmp;
    auto& s_ok = sh.ok;
    auto& s_offset = sh.offset;
    auto& s_total = sh.total;
    auto& s_before = sh.before;
    auto& s_rows_from = sh.rows_from;
    auto& s_hits = sh.hits;
    auto& s_overflow_begin = sh.overflow_begin;
    uint64_t* s_row = sh.row;
    uint32_t* s_tok = sh.tok;
    uint32_t* s_k = sh.k;
    uint32_t* s_pos = sh.pos;
    const bool remote = is_remote(a, s);  // the same in every thread of the block
    const uint8_t* src = from(a, s);      // its counter and rows (counts: from(a, s2))
    const uint32_t tid = threadIdx.x;
    const uint32_t w = a.world, nl = a.local_experts, k = a.topk, p = a.private_slots;
    const uint32_t seq = static_cast<uint32_t>(a.state->seq);
    const uint32_t hw = a.counts_hits_word;
    if (tid == 0) {
        s_offset = 0;
        s_ok = wait_counter(a, counter_at(from(a, s), a.lay.ctr_dispatch, s),
                            uint64_t{seq} * a.dispatch_send_blocks, DeviceError::kRecvWaitRows, s,
                            seq);
    }
    __syncthreads();
    // Group offsets from the counts messages (all here: dispatch_send waited for them).
    for (uint32_t e2 = tid; e2 < e; e2 += blockDim.x) {
        uint32_t tot = 0;
        for (uint32_t s2 = 0; s2 < w; ++s2)
            tot += ld_peer_u32(counts_word(from(a, s2), a, s2, hw + e2), is_remote(a, s2));
        atomicAdd(&s_offset, align_up(tot, a.alignment));
    }
    if (tid == 0) {
        uint32_t tot = 0, before = 0;
        uint64_t ob = 0;
        for (uint32_t s2 = 0; s2 < w; ++s2) {
            uint8_t* src2 = from(a, s2);
            const bool host2 = is_remote(a, s2);
            uint32_t h = ld_peer_u32(counts_word(src2, a, s2, hw + e), host2);
            uint32_t r =
                min(ld_peer_u32(counts_word(src2, a, s2, CountsWords::kRowsTo + a.rank), host2),
                    a.max_tokens);
            tot += h;
            if (s2 < s) {
                before += h;
                ob += r > p ? r - p : 0;
            }
            if (s2 == s) {
                s_rows_from = r;
                s_hits = h;
            }
        }
        s_total = tot;
        s_before = before;
        s_overflow_begin = uint64_t{w} * p + ob;
    }
    __syncthreads();
    const uint32_t offset = s_offset, total = s_total;
    const uint32_t pb16 = a.payload_bytes / 16, spt = a.scales_per_token;
    if (s == 0) {
        // Metadata and zero padding of group e (a grouped GEMM reads whole groups).
        uint32_t end = offset + align_up(total, a.alignment);
        if (tid == 0) {
            out_counts[e] = total;
            out_offsets[e] = offset;
            if (e + 1 == nl) {
                out_offsets[nl] = end;
                a.state->out_rows = end;
            }
        }
        for (uint32_t o = offset + total; o < end && o < a.max_rows; ++o) {
            int4* dst = reinterpret_cast<int4*>(out_x + uint64_t{o} * a.payload_bytes);
            for (uint32_t i = tid; i < pb16; i += blockDim.x) dst[i] = make_int4(0, 0, 0, 0);
            for (uint32_t i = tid; i < spt; i += blockDim.x) out_scale[uint64_t{o} * spt + i] = 0;
            if (tid == 0) {
                a.row_src[o] = RowSource{};
                if (out_sources) out_sources[o] = RowSource{};
            }
        }
    }
    if (!s_ok) return;

    const uint32_t rows_from = s_rows_from;
    const uint64_t overflow_begin = s_overflow_begin;
    uint32_t carry = 0, hit_carry = 0;
    const uint32_t base = offset + s_before;
    for (uint32_t chunk = 0; chunk < rows_from; chunk += blockDim.x) {
        uint32_t i = chunk + tid, match = 0, kk_match = 0, token = 0;
        uint32_t hits = 0, hits_before = 0;  // of this row: all, and those before kk_match
        uint64_t ri = 0;
        if (i < rows_from) {
            ri = i < p ? uint64_t{s} * p + i : overflow_begin + (i - p);
            const uint8_t* row = src + a.lay.dispatch + ri * a.row_bytes;
            // The header in a few 8-byte loads issued together (every (expert, sender) block
            // reads all of the sender's headers, so this is on the critical path): token and
            // call, then the local expert ids, four per load (the header is padded to 16).
            const uint2 head = ld_peer(reinterpret_cast<const uint2*>(row), remote);
            uint2 ids[kMaxCudaTopk / 4];
#pragma unroll
            for (uint32_t q = 0; q < kMaxCudaTopk / 4; ++q)
                if (q * 4 < k)
                    ids[q] =
                        ld_peer(reinterpret_cast<const uint2*>(row + kRowHeaderBytes) + q, remote);
            token = head.x;
            const uint32_t hseq = head.y;
            if (hseq != seq || token >= a.max_tokens) {
                record_error(a, DeviceError::kProtocol, DeviceError::kRecvRows, s, seq,
                             (uint64_t{hseq} << 32) | token, seq);
            } else {
#pragma unroll
                for (uint32_t kk = 0; kk < kMaxCudaTopk; ++kk) {
                    if (kk >= k) break;
                    const uint32_t word = (kk & 2) ? ids[kk / 4].y : ids[kk / 4].x;
                    const auto id = static_cast<int16_t>(word >> (16 * (kk & 1)));
                    if (id == static_cast<int32_t>(e)) {
                        match = 1;
                        kk_match = kk;
                        hits_before = hits;
                    }
                    hits += id >= 0;
                }
            }
        }
        uint32_t pos = 0;
        if (remote) {
            // combine_send returns this sender's results as one compact run in its order:
            // rows in token order, a row's hits in top-k order.
            uint32_t hit_pre, hit_agg;
            Scan(scan_tmp).ExclusiveSum(hits, hit_pre, hit_agg);
            pos = hit_carry + hit_pre + hits_before;
            hit_carry += hit_agg;
            __syncthreads();  // scan_tmp is reused
        }
        uint32_t pre, agg;
        Scan(scan_tmp).ExclusiveSum(match, pre, agg);
        if (match) {
            s_row[pre] = ri;
            s_tok[pre] = token;
            s_k[pre] = kk_match;
            s_pos[pre] = pos;
        }
        __syncthreads();
        // One warp per matched row.
        const uint32_t lane = tid & 31u, warps = blockDim.x / 32;
        for (uint32_t m = tid / 32; m < agg; m += warps) {
            uint32_t o = base + carry + m;
            if (carry + m >= s_hits || o >= a.max_rows) break;  // reported below
            const uint8_t* row = src + a.lay.dispatch + s_row[m] * a.row_bytes;
            warp_copy16<true>(reinterpret_cast<int4*>(out_x + uint64_t{o} * a.payload_bytes),
                              reinterpret_cast<const int4*>(row + a.payload_offset), pb16, lane,
                              remote);
            const float* ssrc = reinterpret_cast<const float*>(row + a.scale_offset);
            for (uint32_t c = lane; c < spt; c += 32)
                out_scale[uint64_t{o} * spt + c] = ld_peer(ssrc + c, remote);
            if (lane == 0) {
                RowSource src_meta{s, s_tok[m], s_k[m]};
                a.row_src[o] = src_meta;
                if (out_sources) out_sources[o] = src_meta;
                if (remote) a.combine_pos[o] = s_pos[m];
            }
        }
        carry += agg;
        __syncthreads();  // s_row and scan_tmp are reused
    }
    if (tid == 0 && carry != s_hits)
        record_error(a, DeviceError::kProtocol, DeviceError::kRecvRows, s, seq, carry, s_hits);
}

__global__ void __launch_bounds__(kRecvThreads)
    dispatch_recv_kernel(KernelArgs a, uint8_t* out_x, float* out_scale, uint32_t* out_counts,
                         uint32_t* out_offsets, RowSource* out_sources) {
    __shared__ RecvShared sh;
    const uint32_t pairs = a.local_experts * a.world;
    for (uint32_t i = blockIdx.x; i < pairs; i += gridDim.x) {
        dispatch_recv_pair(a, i % a.local_experts, i / a.local_experts, sh, out_x, out_scale,
                           out_counts, out_offsets, out_sources);
        __syncthreads();  // sh is reused by the next pair
    }
}

}  // namespace

cudaError_t launch_dispatch_send(const KernelArgs& a, const void* x, const float* x_scale,
                                 const int32_t* indices, const float* weights,
                                 const uint32_t* num_tokens, uint32_t send_blocks,
                                 uint32_t send_threads, cudaStream_t stream) {
    dispatch_plan_kernel<<<1, kPlanThreads, 0, stream>>>(a, indices, weights, num_tokens);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    dispatch_send_kernel<<<send_blocks, send_threads, 0, stream>>>(
        a, static_cast<const uint8_t*>(x), x_scale);
    return cudaGetLastError();
}

cudaError_t launch_dispatch_recv(const KernelArgs& a, void* x, float* x_scale, uint32_t* counts,
                                 uint32_t* offsets, RowSource* sources, cudaStream_t stream) {
    dispatch_recv_kernel<<<a.dispatch_recv_blocks, kRecvThreads, 0, stream>>>(
        a, static_cast<uint8_t*>(x), x_scale, counts, offsets, sources);
    return cudaGetLastError();
}

cudaError_t preload_dispatch_kernels() {
    cudaFuncAttributes attr;
    cudaError_t e = cudaFuncGetAttributes(&attr, dispatch_plan_kernel);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, dispatch_send_kernel);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, dispatch_recv_kernel);
    return e;
}

}  // namespace ferry::moe::cuda
