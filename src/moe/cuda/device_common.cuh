// Device helpers of the MoE kernels: system-scope acquire/release on the arrival counters,
// bounded spin-waits that record where they gave up, and L2-only loads of regions peers write.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moe/cuda/kernels.h"

namespace ferry::moe::cuda {

__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Thread 0 of each block stamps point p: the earliest stamp of the call and the latest stay.
__device__ __forceinline__ void trace_point(const KernelArgs& a, uint32_t p) {
    if (a.trace == nullptr || threadIdx.x != 0) return;
    const unsigned long long t = global_ns();
    atomicMin(&a.trace[p], t);
    atomicMax(&a.trace[kTracePoints + p], t);
}

// Programmatic dependent launch (Hopper): a send kernel lets the receive kernel after it on
// the stream start at once (launched with early_launch), so the launch latency between them
// overlaps the send. Receivers wait for their data through arrival counters, never for the
// send kernel's completion, so starting early is safe; finish_after_sender() at their end
// keeps "this kernel is done" meaning "and the send kernel before it too" for what follows.
__device__ __forceinline__ void let_receiver_start(const KernelArgs& a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (a.early_launch) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void finish_after_sender() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Publishes everything this thread (and, after a __syncthreads, its block) wrote before: a
// release add at system scope (which covers NVLink peers) orders the data before the counter,
// and is cumulative over what the barrier made this thread's. Receivers load with acquire.
// (A sequentially consistent __threadfence_system before a relaxed add did the same, at the
// price of a full fence per signal.)
__device__ __forceinline__ void signal_add(uint64_t* counter, uint64_t n) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(counter), "l"(n) : "memory");
}

// Whether any wait or check of this rank failed, or its host proxy did. The claim flag is in
// device memory: reading the mapped host record in a spin loop would cost a PCIe round trip
// each time. The proxy's word is host memory, but waits look only every 256 spins.
__device__ __forceinline__ bool error_set(const KernelArgs& a) {
    return *reinterpret_cast<const volatile uint32_t*>(&a.state->error_claimed) != 0 ||
           (a.proxy_abort && *reinterpret_cast<const volatile uint32_t*>(a.proxy_abort) != 0);
}

// First failure wins: claimed with a device-memory atomic (atomics on mapped host memory need
// PCIe atomics, which not every host has), then published to the host record with plain
// stores, the code last, so a host that sees the code sees the fields.
__device__ inline void record_error(const KernelArgs& a, uint32_t code, uint32_t phase,
                                    uint32_t peer, uint32_t seq, uint64_t value, uint64_t want) {
    if (atomicCAS(&a.state->error_claimed, 0u, 1u) != 0u) return;
    volatile DeviceError* e = a.err;
    e->phase = phase;
    e->peer = peer;
    e->seq = seq;
    e->value = value;
    e->want = want;
    __threadfence_system();
    e->code = code;
    __threadfence_system();
}

// Spins until *counter >= want. Gives up (false) at the deadline, recording phase and peer,
// or as soon as any other wait of this rank failed, so one dead peer costs one timeout.
// `relayed`: a word another block of this GPU sets after its own wait (wait_remote_counters):
// twice the deadline, so that the wait that names the peer is the one to time out (a spin on
// device memory checks the clock far more often than one over PCIe).
// on_spin(): called after every look that found the counter short.
struct NoSpinWork {
    __device__ void operator()() const {}
};
template <typename OnSpin = NoSpinWork>
__device__ inline bool wait_counter(const KernelArgs& a, const uint64_t* counter, uint64_t want,
                                    uint32_t phase, uint32_t peer, uint32_t seq,
                                    bool relayed = false, OnSpin on_spin = {}) {
    const uint64_t start = global_ns(), timeout = relayed ? 2 * a.timeout_ns : a.timeout_ns;
    for (uint32_t spin = 0;; ++spin) {
        uint64_t v = ld_acquire_sys(counter);
        if (v >= want) return true;
        on_spin();
        if ((spin & 255u) == 255u) {
            if (error_set(a)) return false;
            if (global_ns() - start > timeout) {
                record_error(a, DeviceError::kTimeout, phase, peer, seq, v, want);
                return false;
            }
        }
    }
}

__device__ __forceinline__ uint64_t* counter_at(uint8_t* base, uint64_t offset, uint32_t index) {
    return reinterpret_cast<uint64_t*>(base + offset) + index;
}

__device__ __forceinline__ uint32_t* counts_word(uint8_t* base, const KernelArgs& a,
                                                 uint32_t sender, uint32_t word) {
    return reinterpret_cast<uint32_t*>(base + a.lay.counts + uint64_t{sender} * a.counts_bytes) +
           word;
}

__device__ __forceinline__ bool is_remote(const KernelArgs& a, uint32_t rank) {
    return (a.remote_mask >> rank) & 1u;
}

// Where what `sender` wrote for this rank lies: the region (same node, over NVLink), or the
// proxy's inbox (another node). Same offsets in both. The proxy fills the inbox and raises
// its counters from the host, with no CUDA stream work that could queue behind our kernels.
__device__ __forceinline__ uint8_t* from(const KernelArgs& a, uint32_t sender) {
    return is_remote(a, sender) ? a.inbox : a.self;
}

// Word `word` of the counts message `sender` sent this call: in the region for same-node
// senders, in KernelArgs::counts_mirror for remote ones (after the counts relay).
__device__ __forceinline__ uint32_t counts_in(const KernelArgs& a, uint32_t sender, uint32_t word) {
    const uint32_t* p =
        is_remote(a, sender)
            ? reinterpret_cast<const uint32_t*>(a.counts_mirror + uint64_t{sender} * a.counts_bytes)
            : counts_word(a.self, a, sender, 0);
    return __ldcg(p + word);
}

__device__ __forceinline__ void st_release_gpu(unsigned long long* word, uint64_t v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(word), "l"(v) : "memory");
}

// Stores the call number into a word other blocks of this GPU wait on, after everything this
// block stored before the barrier that preceded the call (thread 0, after __syncthreads).
__device__ __forceinline__ void release_call(unsigned long long* word, uint32_t seq) {
    __threadfence();
    st_release_gpu(word, seq);
}

// Waits until every remote peer's counter at `offset` of the inbox reaches `want`, with one
// block per call polling host memory: the first block to get here (ticket `poll`) waits for
// the counters, runs then() (every thread of the block), and publishes the call number in
// tickets[relay]; the other blocks wait for that word in device memory. With every block
// polling the inbox (~130 pollers, each load a PCIe round trip), the first block of
// dispatch_send got past the counts ~4 us after they arrived, the last ~175 us after, and
// the host proxy saw a put published meanwhile ~60 us late (EP2 over shm, 2026-12-03).
// Called by every thread of every block of the grid, once per call.
// others_wait false: the other blocks go on at once (they wait for what they need their own
// way); words_to: while it waits, the polling block also copies each remote peer's uint64
// word at inbox + words_at into words_to[peer] whenever it changes; order: the block's place
// among the grid's blocks in reaching the wait (0: the polling block).
template <typename Then>
__device__ inline bool wait_remote_counters(const KernelArgs& a, uint32_t poll, uint32_t relay,
                                            uint64_t offset, uint64_t want, uint32_t phase,
                                            uint32_t seq, Then then, bool others_wait = true,
                                            uint64_t words_at = 0,
                                            unsigned long long* words_to = nullptr,
                                            uint32_t* order = nullptr) {
    __shared__ int s_poller, s_ok;
    __shared__ uint32_t s_order;
    const uint32_t tid = threadIdx.x;
    if (tid == 0) {
        const unsigned long long before = atomicAdd(&a.tickets[poll], 1ull);
        s_order = static_cast<uint32_t>(before % gridDim.x);
        s_poller = before == static_cast<unsigned long long>(seq - 1) * gridDim.x;
        s_ok = 1;
    }
    __syncthreads();
    const auto* relayed = reinterpret_cast<const uint64_t*>(a.tickets + relay);
    if (s_poller) {
        if (tid < a.world && is_remote(a, tid)) {
            const auto* watch = reinterpret_cast<const uint64_t*>(a.inbox + words_at) + tid;
            uint64_t seen = 0;
            auto copy_word = [&] {
                if (!words_to) return;
                const uint64_t v = ld_acquire_sys(watch);
                if (v != seen) st_release_gpu(words_to + tid, seen = v);
            };
            if (!wait_counter(a, counter_at(a.inbox, offset, tid), want, phase, tid, seq, false,
                              copy_word))
                s_ok = 0;
        }
        __syncthreads();
        if (s_ok) then();
        __syncthreads();
        if (tid == 0 && s_ok) release_call(a.tickets + relay, seq);
    } else if (others_wait && tid == 0 &&
               !wait_counter(a, relayed, seq, phase, a.rank, seq, true)) {
        s_ok = 0;
    }
    __syncthreads();
    if (order) *order = s_order;
    return s_ok != 0;
}

// Hands a put to the host proxy once its bytes are in the peer's outbox (fenced by the
// caller), or a streamed one before them (proxy::Publish::streamed): offset and length first,
// the call number last, so a proxy that sees the call sees the rest.
__device__ inline void publish_put(const KernelArgs& a, uint32_t peer, uint32_t part, uint32_t seq,
                                   uint64_t offset, uint64_t len, bool streamed = false) {
    volatile proxy::Publish* p = a.publish + uint64_t{peer} * proxy::kParts + part;
    p->offset = offset;
    p->len = len;
    p->streamed = streamed ? 1u : 0u;
    if (a.trace) p->stamp_ns = global_ns();
    __threadfence_system();
    p->seq = seq;
}

// Called by every thread of every block once per call: true in the last block of the grid
// to get here, after the other blocks' stores are visible system-wide (each block fences
// them before taking its ticket; the last block fences after seeing all tickets).
__device__ inline bool last_block_of_call(const KernelArgs& a, uint32_t ticket, uint32_t seq) {
    __shared__ int s_last;
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long before = atomicAdd(&a.tickets[ticket], 1ull);
        s_last = before + 1 == static_cast<unsigned long long>(seq) * gridDim.x;
        __threadfence_system();
    }
    __syncthreads();
    return s_last != 0;
}

// Regions peers write into are read through L2 only: L1 may still hold the previous call.
// The inbox is host memory, of which L2 may hold a stale line: fetched again (ld.cv).
template <typename T>
__device__ __forceinline__ T ld_peer(const T* p, bool host) {
    return host ? __ldcv(p) : __ldcg(p);
}
__device__ __forceinline__ uint32_t ld_peer_u32(const void* p, bool host) {
    return ld_peer(reinterpret_cast<const unsigned int*>(p), host);
}

// One warp copies n16 16-byte vectors, each lane keeping eight loads in flight: a whole
// block per row, one vector per thread and rows one after another, waited out a load latency
// per row (2026-12-01: 30 us for the 128-token combine). kPeerWritten loads with ld_peer
// (`host`: from the inbox).
// The last partial round is predicated rather than a vector at a time: a piece of a row
// (dispatch_send cuts rows into up to 8) is often all remainder.
template <bool kPeerWritten = false>
__device__ __forceinline__ void warp_copy16(int4* dst, const int4* src, uint32_t n16, uint32_t lane,
                                            bool host = false) {
    for (uint32_t i = lane; i < n16 + lane; i += 8 * 32) {
        int4 v[8];
#pragma unroll
        for (uint32_t u = 0; u < 8; ++u)
            if (i + 32 * u < n16)
                v[u] = kPeerWritten ? ld_peer(src + i + 32 * u, host) : src[i + 32 * u];
#pragma unroll
        for (uint32_t u = 0; u < 8; ++u)
            if (i + 32 * u < n16) dst[i + 32 * u] = v[u];
    }
}

}  // namespace ferry::moe::cuda
