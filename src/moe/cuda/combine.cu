// Combine kernels: send puts each expert output row back into slot (token * top-k + k) at the
// rank the token came from; recv sums weight * row per token in fp32, in top-k order with
// separately rounded multiply and add, which is what the CPU backend computes.
#include <cuda_bf16.h>

#include "moe/cuda/device_common.cuh"
#include "moe/cuda/kernels.h"

namespace ferry::moe::cuda {
namespace {

// One warp per expert output row, rows grid-stride. Remote ranks get their results as one
// compact run each (see assign_remote_combine_rows), into their outbox; the others straight
// into slot (token * top-k + k).
__global__ void combine_send_kernel(KernelArgs a, const uint16_t* expert_out) {
    // Remote ranks' runs, in rows: where each wants ours, and how many.
    __shared__ uint32_t s_base[kMaxCudaWorld], s_hits[kMaxCudaWorld];
    const uint32_t tid = threadIdx.x, w = a.world, k = a.topk;
    const uint32_t lane = tid & 31u, warps = blockDim.x / 32;
    const uint32_t seq = static_cast<uint32_t>(a.state->seq), rows = a.state->out_rows;
    const uint64_t row_bytes = uint64_t{a.hidden} * sizeof(uint16_t);
    const uint32_t n16 = static_cast<uint32_t>(row_bytes / 16);
    trace_point(a, kTrCombineSendBegin);
    let_receiver_start(a);
    if (a.remote_mask) {
        if (tid < w && is_remote(a, tid)) {
            // Where rank tid wants our results, from its counts message of this call (in the
            // inbox: it is remote).
            uint32_t base =
                ld_peer_u32(counts_word(a.inbox, a, tid, CountsWords::kCombineBase), true);
            uint32_t hits = ld_peer_u32(counts_word(a.inbox, a, tid, CountsWords::kHits), true);
            if (uint64_t{base} + hits > a.remote_combine) {
                if (blockIdx.x == 0)
                    record_error(a, DeviceError::kProtocol, DeviceError::kCombineSend, tid, seq,
                                 uint64_t{base} + hits, a.remote_combine);
                base = hits = 0;
            }
            s_base[tid] = base;
            s_hits[tid] = hits;
        }
        __syncthreads();
    }
    for (uint32_t o = blockIdx.x * warps + tid / 32; o < rows && o < a.max_rows;
         o += gridDim.x * warps) {
        const RowSource src = a.row_src[o];
        if (src.rank == RowSource::kPadding) continue;
        if (src.rank >= w || src.token >= a.max_tokens || src.k >= k) {
            if (lane == 0)
                record_error(a, DeviceError::kProtocol, DeviceError::kCombineSend, src.rank, seq,
                             src.token, a.max_tokens);
            continue;
        }
        uint64_t slot = uint64_t{src.token} * k + src.k;
        if (is_remote(a, src.rank)) {
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
                    reinterpret_cast<const int4*>(expert_out + uint64_t{o} * a.hidden), n16, lane);
    }
    __threadfence_system();
    __syncthreads();
    if (tid < w && !is_remote(a, tid))
        signal_add(counter_at(a.peers[tid], a.lay.ctr_combine, a.rank), 1);
    if (a.remote_mask && last_block_of_call(a, kTicketCombine, seq) && tid < w && is_remote(a, tid))
        publish_put(a, tid, proxy::kCombine, seq,
                    a.lay.combine + (uint64_t{a.remote_combine} + s_base[tid]) * row_bytes,
                    uint64_t{s_hits[tid]} * row_bytes);
    trace_point(a, kTrCombineSendEnd);
}

// kSlots (worlds with remote ranks): a (token, k) row is where combine_slot says, since
// remote ranks' results sit in a compact area after the slots, in the inbox.
template <bool kBf16Out, bool kSlots>
__global__ void combine_recv_kernel(KernelArgs a, float* out_f32, uint16_t* out_bf16) {
    __shared__ int s_ok;
    __shared__ float s_wt[kMaxCudaTopk];
    __shared__ int s_use[kMaxCudaTopk];
    __shared__ uint32_t s_slot[kMaxCudaTopk];
    const uint32_t tid = threadIdx.x, w = a.world, k = a.topk;
    const uint32_t seq = static_cast<uint32_t>(a.state->seq), n = a.state->num_tokens;
    trace_point(a, kTrCombineRecvBegin);
    if (tid == 0) {
        int ok = 1;
        for (uint32_t s = 0; s < w && ok; ++s)
            ok = wait_counter(a, counter_at(from(a, s), a.lay.ctr_combine, s),
                              uint64_t{seq} * a.combine_send_blocks, DeviceError::kCombineRecvWait,
                              s, seq);
        s_ok = ok;
    }
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
    for (uint32_t t = blockIdx.x; t < n; t += gridDim.x) {
        if (tid < k) {
            s_use[tid] = a.indices[t * k + tid] >= 0;
            s_wt[tid] = a.weights[t * k + tid];
            if constexpr (kSlots) s_slot[tid] = a.combine_slot[t * k + tid];
        }
        __syncthreads();
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
    combine_send_kernel<<<blocks, threads, 0, stream>>>(a, expert_out);
    return cudaGetLastError();
}

cudaError_t launch_combine_recv(const KernelArgs& a, float* out_f32, uint16_t* out_bf16,
                                uint32_t blocks, uint32_t threads, cudaStream_t stream) {
    const bool slots = a.remote_mask != 0, early = a.early_launch != 0;
    if (out_bf16 && slots)
        return launch_after(early, combine_recv_kernel<true, true>, blocks, threads, 0, stream, a,
                            static_cast<float*>(nullptr), out_bf16);
    if (out_bf16)
        return launch_after(early, combine_recv_kernel<true, false>, blocks, threads, 0, stream, a,
                            static_cast<float*>(nullptr), out_bf16);
    if (slots)
        return launch_after(early, combine_recv_kernel<false, true>, blocks, threads, 0, stream, a,
                            out_f32, static_cast<uint16_t*>(nullptr));
    return launch_after(early, combine_recv_kernel<false, false>, blocks, threads, 0, stream, a,
                        out_f32, static_cast<uint16_t*>(nullptr));
}

cudaError_t preload_combine_kernels() {
    cudaFuncAttributes attr;
    cudaError_t e = cudaFuncGetAttributes(&attr, combine_send_kernel);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, combine_recv_kernel<true, false>);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, combine_recv_kernel<false, false>);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, combine_recv_kernel<true, true>);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, combine_recv_kernel<false, true>);
    return e;
}

}  // namespace ferry::moe::cuda
