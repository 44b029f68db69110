// Two TransferEngines in one process: register memory on both, write with an immediate from
// one into the other, wait for the immediate at the target and check every byte.
//   engine_write [tcp|shm]
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ferry/fabric/engine.h"

int main(int argc, char** argv) {
    ferry::EngineConfig cfg;
    cfg.provider = argc > 1 ? argv[1] : "tcp";
    cfg.peers_on_same_host = true;
    cfg.op_timeout = std::chrono::seconds(5);
    auto a = ferry::TransferEngine::create(cfg);
    auto b = ferry::TransferEngine::create(cfg);
    if (!a.ok() || !b.ok()) {
        std::fprintf(stderr, "engine: %s\n",
                     (a.ok() ? b.status() : a.status()).to_string().c_str());
        return 1;
    }

    constexpr size_t kSize = 1 << 20;
    std::vector<uint8_t> src(kSize), dst(kSize, 0xAB);
    for (size_t i = 0; i < kSize; ++i) src[i] = static_cast<uint8_t>(i * 7 + 3);
    auto src_mr = (*a)->register_memory(src.data(), src.size());
    auto dst_mr = (*b)->register_memory(dst.data(), dst.size());
    if (!src_mr.ok() || !dst_mr.ok()) {
        std::fprintf(stderr, "register: %s\n",
                     (src_mr.ok() ? dst_mr.status() : src_mr.status()).to_string().c_str());
        return 1;
    }
    // What a peer would receive over any channel: b's address and its region's descriptor.
    auto addr = ferry::EngineAddress::deserialize((*b)->address().serialize());
    auto desc = ferry::MemoryDescriptor::deserialize((*dst_mr)->descriptor().serialize());
    auto peer = (*a)->connect(*addr);
    if (!peer.ok()) {
        std::fprintf(stderr, "connect: %s\n", peer.status().to_string().c_str());
        return 1;
    }

    constexpr uint32_t kImm = 42;
    constexpr size_t kOffset = 4096, kLen = kSize - 2 * 4096;
    ferry::OpHandle op = (*a)->write({*peer, src_mr->get(), 0, &*desc, kOffset, kLen, kImm});
    ferry::Status s = op.wait(std::chrono::seconds(10));
    if (s.ok()) s = (*b)->wait_imm(kImm, op.imm_writes(), std::chrono::seconds(10));
    if (!s.ok()) {
        std::fprintf(stderr, "write: %s\n", s.to_string().c_str());
        return 1;
    }
    for (size_t i = 0; i < kSize; ++i) {
        uint8_t want = (i >= kOffset && i < kOffset + kLen) ? src[i - kOffset] : 0xAB;
        if (dst[i] != want) {
            std::fprintf(stderr, "byte %zu: got %#x, want %#x\n", i, dst[i], want);
            return 1;
        }
    }
    std::printf("engine_write: %zu bytes over %s with immediate %u (%u writes counted): OK\n", kLen,
                (*a)->provider().c_str(), kImm, op.imm_writes());
    return 0;
}
