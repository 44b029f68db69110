// Combine kernels: send puts each expert output row back into slot (token * top-k + k) at the
// rank the token came from; recv sums weight * row per token in fp32, in top-k order with
// separately rounded multiply and add, which is what the CPU backend computes.
#include <cuda_bf16.h>

#include "moe/cuda/device_common.cuh"
#include "moe/cuda/kernels.h"

namespace ferry::moe::cuda {
namespace {

// Remote rank `peer`'s run of our combine rows, from its counts message of this call (in the
// mirror): x = the first row it wants them at, y = how many (its hits here, or with
// `rows_sent` the rows it sent here). 0/0, with an error recorded once, when that would leave
// the area.
__device__ inline uint2 remote_combine_run(const KernelArgs& a, uint32_t peer, uint32_t seq,
                                           bool rows_sent) {
    const uint32_t base = counts_in(a, peer, CountsWords::kCombineBase);
    const uint32_t rows =
        counts_in(a, peer, rows_sent ? CountsWords::kRowsTo + a.rank : CountsWords::kHits);
    if (uint64_t{base} + rows <= a.remote_combine) return make_uint2(base, rows);
    if (blockIdx.x == 0)
        record_error(a, DeviceError::kProtocol, DeviceError::kCombineSend, peer, seq,
                     uint64_t{base} + rows, a.remote_combine);
    return make_uint2(0, 0);
}

// End of a combine send block: +1 on every same-node peer's combine counter (after the
// barrier, signal_add's fence covers every warp's rows); the last block of the call hands each
// remote rank's run (rows [base, base + rows) of the remote area) to the proxy, unless the
// run was streamed (handed over piece by piece already).
__device__ inline void finish_combine_send(const KernelArgs& a, uint32_t seq,
                                           const uint32_t* s_base, const uint32_t* s_rows,
                                           bool streamed) {
    const uint32_t tid = threadIdx.x, w = a.world;
    const uint64_t row_bytes = uint64_t{a.hidden} * sizeof(uint16_t);
    __syncthreads();
    if (tid < w && !is_remote(a, tid))
        signal_add(counter_at(a.peers[tid], a.lay.ctr_combine, a.rank), 1);
    if (a.remote_mask && !streamed && last_block_of_call(a, kTicketCombine, seq) && tid < w &&
        is_remote(a, tid))
        publish_put(a, tid, proxy::kCombine, seq,
                    a.lay.combine + (uint64_t{a.remote_combine} + s_base[tid]) * row_bytes,
                    uint64_t{s_rows[tid]} * row_bytes);
    trace_point(a, kTrCombineSendEnd);
}

// A streamed combine's remote rows (KernelArgs::piece_rows): item j of the remote runs (back
// to back in rank order, s_rstart) is row combine_inv[j]; warp gw < rwarps writes items gw,
// gw + rwarps, ... one after another, so the runs fill in order, a few pieces at a time, and
// the warp that completes a piece hands it to the proxy. A row that fails its checks is still
// counted (its error fails the call; the proxy must not wait for it).
__device__ inline void send_streamed_rows(const KernelArgs& a, const uint16_t* expert_out,
                                          uint32_t seq, uint32_t rows, bool slabs,
                                          const uint32_t* s_base, const uint32_t* s_hits,
                                          const uint32_t* s_rstart, uint32_t gw, uint32_t rwarps) {
    const uint32_t lane = threadIdx.x & 31u, w = a.world;
    const uint64_t row_bytes = uint64_t{a.hidden} * sizeof(uint16_t);
    const uint32_t n16 = static_cast<uint32_t>(row_bytes / 16);
    for (uint32_t j = gw; j < s_rstart[w]; j += rwarps) {
        uint32_t d = 0;
        while (d + 1 < w && j >= s_rstart[d + 1]) ++d;
        const uint32_t pos = j - s_rstart[d];
        const uint32_t o = j < a.max_rows ? a.combine_inv[j] : ~0u;
        const RowSource src = o < rows && o < a.max_rows ? a.row_src[o] : RowSource{};
        const uint32_t at = o < rows && o < a.max_rows ? a.combine_pos[o] : ~0u;
        if (src.rank != d || at != pos || src.token >= a.max_tokens || src.k >= a.topk) {
            if (lane == 0)
                record_error(a, DeviceError::kProtocol, DeviceError::kCombineSend, d, seq, pos, o);
        } else {
            const uint64_t in_row = slabs ? a.out_row[o] : o;
            uint8_t* dst = a.peers[d] + a.lay.combine +
                           (uint64_t{a.remote_combine} + s_base[d] + pos) * row_bytes;
            warp_copy16(reinterpret_cast<int4*>(dst),
                        reinterpret_cast<const int4*>(expert_out + in_row * a.hidden), n16, lane);
        }
        // Every lane's stores out to host memory before the row counts.
        __threadfence_system();
        __syncwarp();
        if (lane == 0) {
            const uint32_t piece = pos / a.piece_rows;
            const uint32_t in_piece = min(a.piece_rows, s_hits[d] - piece * a.piece_rows);
            const uint64_t at_piece = uint64_t{d} * a.max_pieces + piece;
            if (atomicAdd(&a.piece_done[at_piece], 1u) + 1 == in_piece) {
                a.piece_done[at_piece] = 0;  // the next call's rows count from zero
                __threadfence_system();
                *reinterpret_cast<volatile uint32_t*>(&a.stream_ready[at_piece]) = seq;
            }
        }
    }
}

// One warp per expert output row, rows grid-stride. Remote ranks get their results as one
// compact run each (see assign_remote_combine_rows), into their outbox; the others straight
// into slot (token * top-k + k). Streamed (KernelArgs::piece_rows): the remote runs are
// announced to the proxy first, written in run order by the first warps (send_streamed_rows),
// the other rows by the rest.
__global__ void combine_send_kernel(KernelArgs a, const uint16_t* expert_out) {
    // Remote ranks' runs, in rows: where each wants ours, and how many.
    __shared__ uint32_t s_base[kMaxCudaWorld], s_hits[kMaxCudaWorld];
    __shared__ uint32_t s_rstart[kMaxCudaWorld + 1];
    const uint32_t tid = threadIdx.x, w = a.world, k = a.topk;
    const uint32_t lane = tid & 31u, warps = blockDim.x / 32;
    const uint32_t seq = static_cast<uint32_t>(a.state->seq), rows = a.state->out_rows;
    const bool slabs = a.state->out_capacity != 0;
    const bool streamed = a.remote_mask && a.piece_rows;
    const uint64_t row_bytes = uint64_t{a.hidden} * sizeof(uint16_t);
    const uint32_t n16 = static_cast<uint32_t>(row_bytes / 16);
    trace_point(a, kTrCombineSendBegin);
    let_receiver_start(a);
    if (a.remote_mask) {
        if (tid < w) {
            const uint2 run =
                is_remote(a, tid) ? remote_combine_run(a, tid, seq, false) : make_uint2(0, 0);
            s_base[tid] = run.x;
            s_hits[tid] = run.y;
        }
        __syncthreads();
    }
    // Rows o of this warp: all of them, or (streamed) those the remote runs leave to it.
    uint32_t first = blockIdx.x * warps + tid / 32, stride = gridDim.x * warps;
    if (streamed) {
        if (tid == 0) {
            uint32_t r = 0;
            for (uint32_t d = 0; d < w; ++d) {
                s_rstart[d] = r;
                r += s_hits[d];
            }
            s_rstart[w] = r;
        }
        __syncthreads();
        if (blockIdx.x == 0 && tid < w && is_remote(a, tid))
            publish_put(a, tid, proxy::kCombine, seq,
                        a.lay.combine + (uint64_t{a.remote_combine} + s_base[tid]) * row_bytes,
                        uint64_t{s_hits[tid]} * row_bytes, true);
        // About eight rows per streaming warp: enough warps to keep the host link busy, few
        // enough that the runs complete piece by piece rather than all at the end.
        const uint32_t num_warps = gridDim.x * warps;
        const uint32_t rwarps = max(1u, min(num_warps, (s_rstart[w] + 7) / 8));
        const uint32_t gw = (tid / 32) * gridDim.x + blockIdx.x;  // SMs first
        if (gw < rwarps)
            send_streamed_rows(a, expert_out, seq, rows, slabs, s_base, s_hits, s_rstart, gw,
                               rwarps);
        if (rwarps < num_warps) {
            first = gw < rwarps ? rows : gw - rwarps;
            stride = num_warps - rwarps;
        } else {
            first = gw;
        }
    }
    for (uint32_t o = first; o < rows && o < a.max_rows; o += stride) {
        const RowSource src = a.row_src[o];
        // Loaded beside the source rather than after the checks below, which wait for it: so
        // a row pays one load round trip, not two in a row.
        const uint64_t in_row = slabs ? a.out_row[o] : o;
        if (src.rank == RowSource::kPadding) continue;
        if (src.rank >= w || src.token >= a.max_tokens || src.k >= k) {
            if (lane == 0)
                record_error(a, DeviceError::kProtocol, DeviceError::kCombineSend, src.rank, seq,
                             src.token, a.max_tokens);
            continue;
        }
        uint64_t slot = uint64_t{src.token} * k + src.k;
        if (is_remote(a, src.rank)) {
            if (streamed) continue;  // send_streamed_rows wrote it
            const uint32_t pos = a.combine_pos[o];
            if (pos >= s_hits[src.rank]) {
                if (lane == 0)
                    record_error(a, DeviceError::kProtocol, DeviceError::kCombineSend, src.rank,
                                 seq, pos, s_hits[src.rank]);
                continue;
            }
            slot = uint64_t{a.remote_combine} + s_base[src.rank] + pos;
        }
        uint8_t* dst = a.peers[src.rank] + a.lay.combine + slot * row_bytes;
        warp_copy16(reinterpret_cast<int4*>(dst),
                    reinterpret_cast<const int4*>(expert_out + in_row * a.hidden), n16, lane);
    }
    finish_combine_send(a, seq, s_base, s_hits, streamed);
}

// CombineMode::kPerRank: a warp per (received row, piece of it) sums weight * output over the
// row's choices in top-k order (fp32, separately rounded multiply and add: the CPU backend's
// arithmetic), rounds to bf16 and stores one partial at the row's sender: slot
// (token * top-k + first choice here) for same-node ranks, the sender's compact run (its row
// order, at the base its counts message announced) for remote ones.
constexpr uint32_t kCombineThreads = 512;
constexpr uint32_t kMaxRowPieces = 8;

__global__ void __launch_bounds__(kCombineThreads)
    combine_send_partial_kernel(KernelArgs a, const uint16_t* expert_out) {
    __shared__ uint32_t s_base[kMaxCudaWorld], s_rows[kMaxCudaWorld], s_start[kMaxCudaWorld + 1];
    __shared__ uint32_t s_o[kCombineThreads / 32][kMaxCudaTopk];
    __shared__ float s_w[kCombineThreads / 32][kMaxCudaTopk];
    const uint32_t tid = threadIdx.x, w = a.world, k = a.topk;
    const uint32_t lane = tid & 31u, warp = tid / 32;
    const uint32_t seq = static_cast<uint32_t>(a.state->seq), out_rows = a.state->out_rows;
    const bool slabs = a.state->out_capacity != 0;
    const uint64_t row_bytes = uint64_t{a.hidden} * sizeof(uint16_t);
    const uint32_t n16 = a.hidden / 8;
    trace_point(a, kTrCombineSendBegin);
    let_receiver_start(a);
    if (tid <= w) s_start[tid] = min(a.recv_start[tid], w * a.max_tokens);
    if (tid < w) {
        // A partial per row rank tid sent us.
        const uint2 run =
            is_remote(a, tid) ? remote_combine_run(a, tid, seq, true) : make_uint2(0, 0);
        s_base[tid] = run.x;
        s_rows[tid] = run.y;
    }
    __syncthreads();
    const uint32_t total = s_start[w];
    const uint32_t num_warps = gridDim.x * (blockDim.x / 32);
    const uint32_t gw = warp * gridDim.x + blockIdx.x;
    const uint32_t pieces = total == 0 ? 1 : max(1u, min(kMaxRowPieces, num_warps / total));
    for (uint32_t u = gw; u < total * pieces; u += num_warps) {
        const uint32_t g = u / pieces, piece = u % pieces;
        uint32_t s = 0;
        while (s + 1 < w && g >= s_start[s + 1]) ++s;
        const uint32_t i = g - s_start[s];
        const uint32_t my_o = lane < k ? a.recv_o[uint64_t{g} * k + lane] : ~0u;
        const float my_w = lane < k ? a.recv_w[uint64_t{g} * k + lane] : 0.0f;
        const uint32_t token = a.recv_token[g];
        const uint32_t hm = __ballot_sync(0xffffffffu, my_o != ~0u);
        const bool remote = is_remote(a, s);
        const bool bad = __any_sync(0xffffffffu, my_o != ~0u && my_o >= out_rows) ||
                         token >= a.max_tokens || hm == 0 || (remote && i >= s_rows[s]);
        if (bad) {
            if (lane == 0 && piece == 0)
                record_error(a, DeviceError::kProtocol, DeviceError::kCombineSend, s, seq,
                             (uint64_t{token} << 32) | i, out_rows);
            continue;
        }
        const uint64_t slot = remote ? uint64_t{a.remote_combine} + s_base[s] + i
                                     : uint64_t{token} * k + (__ffs(hm) - 1);
        int4* dst = reinterpret_cast<int4*>(a.peers[s] + a.lay.combine + slot * row_bytes);
        if (lane < kMaxCudaTopk) {
            // In the caller's layout (slabs: where dispatch_recv wrote the row).
            s_o[warp][lane] = slabs && my_o != ~0u ? a.out_row[my_o] : my_o;
            s_w[warp][lane] = my_w;
        }
        __syncwarp();
        const uint32_t lo = n16 * piece / pieces, hi = n16 * (piece + 1) / pieces;
        // Two vectors per lane and up to 8 choices' loads in flight at once (a row with more
        // choices here takes a second round, still in top-k order): one vector per choice
        // waited out a load latency per 512 bytes (19 us for a 128-token call, 2026-12-01).
        for (uint32_t c = lo + lane; c < hi; c += 64) {
            const bool two = c + 32 < hi;
            float acc[2][8] = {};
            for (uint32_t k0 = 0; k0 < k; k0 += 8) {
                const uint32_t m = (hm >> k0) & 0xffu;
                if (!m) continue;
                int4 v[2][8];
#pragma unroll
                for (uint32_t j = 0; j < 8; ++j) {
                    if (!((m >> j) & 1u)) continue;
                    const int4* src = reinterpret_cast<const int4*>(
                        expert_out + uint64_t{s_o[warp][k0 + j]} * a.hidden);
                    v[0][j] = src[c];
                    if (two) v[1][j] = src[c + 32];
                }
#pragma unroll
                for (uint32_t j = 0; j < 8; ++j) {
                    if (!((m >> j) & 1u)) continue;
                    const float wt = s_w[warp][k0 + j];
#pragma unroll
                    for (uint32_t u = 0; u < 2; ++u) {
                        const auto* h = reinterpret_cast<const __nv_bfloat16*>(&v[u][j]);
                        for (int e = 0; e < 8; ++e)
                            acc[u][e] = __fadd_rn(acc[u][e], __fmul_rn(wt, __bfloat162float(h[e])));
                    }
                }
            }
#pragma unroll
            for (uint32_t u = 0; u < 2; ++u) {
                if (u == 1 && !two) break;
                int4 packed;
                auto* ph = reinterpret_cast<__nv_bfloat16*>(&packed);
                for (int e = 0; e < 8; ++e) ph[e] = __float2bfloat16_rn(acc[u][e]);
                dst[c + 32 * u] = packed;
            }
        }
        __syncwarp();  // s_o and s_w are rewritten for the warp's next row
    }
    finish_combine_send(a, seq, s_base, s_rows, false);
}

// Waits until the piece of remote rank d's combine run holding combine row `slot` is in the
// inbox (KernelArgs::piece_seen), or the whole run is (the combine relay). Twice the deadline
// of the polling block's wait, which names a silent peer first.
__device__ inline bool wait_piece(const KernelArgs& a, uint32_t d, uint32_t slot, uint32_t seq) {
    const uint32_t pos = slot - a.remote_combine - __ldcg(&a.combine_base[d]);
    const uint64_t need = (uint64_t{seq} << 32) | (pos / a.piece_rows + 1);
    const auto* seen = reinterpret_cast<const uint64_t*>(a.piece_seen + d);
    const auto* whole = reinterpret_cast<const uint64_t*>(a.tickets + kTicketCombineRelay);
    const uint64_t start = global_ns();
    for (uint32_t spin = 0;; ++spin) {
        if (ld_acquire_sys(seen) >= need || ld_acquire_sys(whole) >= seq) return true;
        if ((spin & 255u) == 255u) {
            if (error_set(a)) return false;
            if (global_ns() - start > 2 * a.timeout_ns) {
                record_error(a, DeviceError::kTimeout, DeviceError::kCombineRecvWait, d, seq, pos,
                             need);
                return false;
            }
        }
    }
}

// kSlots (worlds with remote ranks): a (token, k) row is where combine_slot says, since
// remote ranks' results sit in a compact area after the slots, in the inbox. With pieces
// (KernelArgs::piece_seen), one block polls the inbox and relays the piece words, and every
// other block sums a token as soon as the pieces holding its remote rows are in: the reads of
// host memory run beside the copies of the later pieces instead of after the last.
// weights: the caller's for this combine ([num_tokens * top-k]), or null for the dispatched
// ones; read here rather than copied in first, which would cost a launch per call.
template <bool kBf16Out, bool kSlots>
__global__ void combine_recv_kernel(KernelArgs a, float* out_f32, uint16_t* out_bf16,
                                    const float* weights) {
    __shared__ int s_ok, s_late;
    __shared__ float s_wt[kMaxCudaTopk];
    __shared__ int32_t s_e[kMaxCudaTopk];
    __shared__ int s_use[kMaxCudaTopk];
    __shared__ uint32_t s_slot[kMaxCudaTopk];
    const uint32_t tid = threadIdx.x, w = a.world, k = a.topk;
    const uint32_t seq = static_cast<uint32_t>(a.state->seq), n = a.state->num_tokens;
    const bool by_piece = kSlots && a.piece_seen != nullptr;
    trace_point(a, kTrCombineRecvBegin);
    // Thread kk < top-k holds choice kk of the block's next token, loaded while the block
    // sums the current one: a token then waits for no load of its routing (a round trip per
    // token, and a block sums 63 tokens one after another at 4096 tokens on a shared GPU).
    int32_t next_e = -1;
    float next_w = 0.0f;
    uint32_t next_slot = 0;
    auto fetch = [&](uint32_t t) {
        if (tid >= k || t >= n) return;
        next_e = a.indices[t * k + tid];
        next_w = weights ? weights[t * k + tid] : a.weights[t * k + tid];
        if constexpr (kSlots) next_slot = a.combine_slot[t * k + tid];
    };
    // Tokens first, first + stride, ...: by piece, the polling block takes none (it relays
    // the pieces until the last is in, and a token of its own would wait that long), the
    // others share them in the order they reached the wait.
    uint32_t first = blockIdx.x, stride = gridDim.x;
    if (!by_piece) fetch(first);  // local data: loaded while thread 0 waits for the peers
    const uint64_t want = uint64_t{seq} * a.combine_send_blocks;
    if (tid == 0) {
        int ok = 1;
        for (uint32_t s = 0; s < w && ok; ++s)
            ok = is_remote(a, s) || wait_counter(a, counter_at(a.self, a.lay.ctr_combine, s), want,
                                                 DeviceError::kCombineRecvWait, s, seq);
        s_ok = ok;
    }
    uint32_t order = 0;
    const bool remote_ok =
        !kSlots || wait_remote_counters(
                       a, kTicketCombinePoll, kTicketCombineRelay, a.lay.ctr_combine, want,
                       DeviceError::kCombineRecvWait, seq, [] {}, !by_piece, a.piece_words,
                       a.piece_seen, &order);
    if (!remote_ok && tid == 0) s_ok = 0;
    if (by_piece && gridDim.x > 1) {
        first = order == 0 ? n : order - 1;
        stride = gridDim.x - 1;
        fetch(first);
    } else if (by_piece) {
        fetch(first);
    }
    if (tid == 0) s_late = 0;
    __syncthreads();
    trace_point(a, kTrCombineRecvRowsIn);
    if (!s_ok) {
        finish_after_sender();
        return;
    }
    const uint32_t n8 = a.hidden / 8;
    const uint8_t* recv = a.self + a.lay.combine;
    const uint8_t* recv_remote = kSlots ? a.inbox + a.lay.combine : nullptr;
    const uint64_t row_bytes = uint64_t{a.hidden} * sizeof(uint16_t);
    for (uint32_t t = first; t < n; t += stride) {
        if (tid < k) {
            s_e[tid] = next_e;
            // Per-rank partials are weighted already (and 1 * x is x exactly, so the sum
            // below is the plain sum of the partials).
            s_wt[tid] = a.combine_per_rank ? 1.0f : next_w;
            if constexpr (kSlots) s_slot[tid] = next_slot;
        }
        fetch(t + stride);
        __syncthreads();
        if (tid < k) {
            const int32_t e = s_e[tid];
            bool use = e >= 0;
            // Per-rank partials: one per rank, at its first choice.
            if (a.combine_per_rank && use)
                for (uint32_t j = 0; j < tid; ++j)
                    use = use && !(s_e[j] >= 0 && static_cast<uint32_t>(s_e[j]) / a.local_experts ==
                                                      static_cast<uint32_t>(e) / a.local_experts);
            s_use[tid] = use;
            if (by_piece && use && s_slot[tid] >= a.remote_combine &&
                !wait_piece(a, static_cast<uint32_t>(e) / a.local_experts, s_slot[tid], seq))
                s_late = 1;
        }
        __syncthreads();
        if (s_late) break;  // recorded
        const uint8_t* rows_t = recv + uint64_t{t} * k * row_bytes;
        for (uint32_t c8 = tid; c8 < n8; c8 += blockDim.x) {
            // Every top-k load in flight first, then the sums in top-k order.
            int4 v[kMaxCudaTopk];
#pragma unroll
            for (uint32_t kk = 0; kk < kMaxCudaTopk; ++kk)
                if (kk < k && s_use[kk]) {
                    // The same in every thread: s_slot is per token.
                    const bool host = kSlots && s_slot[kk] >= a.remote_combine;
                    const uint8_t* row = !kSlots ? rows_t + kk * row_bytes
                                         : host  ? recv_remote + uint64_t{s_slot[kk]} * row_bytes
                                                 : recv + uint64_t{s_slot[kk]} * row_bytes;
                    v[kk] = ld_peer(reinterpret_cast<const int4*>(row) + c8, host);
                }
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
            for (uint32_t kk = 0; kk < kMaxCudaTopk; ++kk) {
                if (kk >= k || !s_use[kk]) continue;
                const float wt = s_wt[kk];
                const auto* h = reinterpret_cast<const __nv_bfloat16*>(&v[kk]);
                for (int i = 0; i < 8; ++i)
                    acc[i] = __fadd_rn(acc[i], __fmul_rn(wt, __bfloat162float(h[i])));
            }
            if constexpr (kBf16Out) {
                int4 packed;
                auto* h = reinterpret_cast<__nv_bfloat16*>(&packed);
                for (int i = 0; i < 8; ++i) h[i] = __float2bfloat16_rn(acc[i]);
                reinterpret_cast<int4*>(out_bf16 + uint64_t{t} * a.hidden)[c8] = packed;
            } else {
                float4* o = reinterpret_cast<float4*>(out_f32 + uint64_t{t} * a.hidden) + 2 * c8;
                o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
                o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
            }
        }
        __syncthreads();  // s_use and s_wt are reused by the next token
    }
    trace_point(a, kTrCombineRecvEnd);
    finish_after_sender();
}

}  // namespace

cudaError_t launch_combine_send(const KernelArgs& a, const uint16_t* expert_out, uint32_t blocks,
                                uint32_t threads, cudaStream_t stream) {
    if (a.combine_per_rank)
        combine_send_partial_kernel<<<blocks, min(threads, kCombineThreads), 0, stream>>>(
            a, expert_out);
    else
        combine_send_kernel<<<blocks, threads, 0, stream>>>(a, expert_out);
    return cudaGetLastError();
}

cudaError_t launch_combine_recv(const KernelArgs& a, float* out_f32, uint16_t* out_bf16,
                                const float* weights, uint32_t blocks, uint32_t threads,
                                cudaStream_t stream) {
    const bool slots = a.remote_mask != 0, early = a.early_launch != 0;
    if (out_bf16 && slots)
        return launch_after(early, combine_recv_kernel<true, true>, blocks, threads, 0, stream, a,
                            static_cast<float*>(nullptr), out_bf16, weights);
    if (out_bf16)
        return launch_after(early, combine_recv_kernel<true, false>, blocks, threads, 0, stream, a,
                            static_cast<float*>(nullptr), out_bf16, weights);
    if (slots)
        return launch_after(early, combine_recv_kernel<false, true>, blocks, threads, 0, stream, a,
                            out_f32, static_cast<uint16_t*>(nullptr), weights);
    return launch_after(early, combine_recv_kernel<false, false>, blocks, threads, 0, stream, a,
                        out_f32, static_cast<uint16_t*>(nullptr), weights);
}

cudaError_t preload_combine_kernels() {
    cudaFuncAttributes attr;
    cudaError_t e = cudaFuncGetAttributes(&attr, combine_send_kernel);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, combine_send_partial_kernel);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, combine_recv_kernel<true, false>);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, combine_recv_kernel<false, false>);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, combine_recv_kernel<true, true>);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, combine_recv_kernel<false, true>);
    return e;
}

}  // namespace ferry::moe::cuda
