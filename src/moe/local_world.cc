#include "ferry/moe/local_world.h"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <thread>

namespace ferry::moe {

struct LocalWorld::Rank {
    struct Free {
        void operator()(uint8_t* p) const { std::free(p); }
    };
    std::unique_ptr<uint8_t, Free> memory;
    std::unique_ptr<MappedTransport> transport;
    std::unique_ptr<CpuBackend> backend;
};

LocalWorld::~LocalWorld() = default;

CpuBackend& LocalWorld::rank(uint32_t r) { return *ranks_[r]->backend; }

Result<std::unique_ptr<LocalWorld>> LocalWorld::create(const AllToAllConfig& cfg,
                                                       Duration timeout) {
    AllToAllConfig c = cfg;
    c.rank = 0;
    FERRY_RETURN_IF_ERROR(c.validate());
    RankMemoryLayout layout = RankMemoryLayout::of(c);
    std::unique_ptr<LocalWorld> world(new LocalWorld());
    std::vector<MappedPeer> peers;
    for (uint32_t r = 0; r < c.world_size; ++r) {
        auto rank = std::make_unique<Rank>();
        auto* p = static_cast<uint8_t*>(std::aligned_alloc(4096, layout.total_bytes));
        if (!p)
            return resource_exhausted(
                fmt::format("LocalWorld: cannot allocate {} bytes for "
                            "rank {}",
                            layout.total_bytes, r));
        std::memset(p, 0, layout.total_bytes);
        rank->memory.reset(p);
        peers.push_back(layout.peer_view(p, c.world_size));
        world->ranks_.push_back(std::move(rank));
    }
    for (uint32_t r = 0; r < c.world_size; ++r) {
        uint8_t* base = world->ranks_[r]->memory.get();
        std::span<uint8_t> stage[kNumRegions], recv[kNumRegions];
        for (int i = 0; i < kNumRegions; ++i) {
            stage[i] = {base + layout.stage_offset[i], layout.stage_size[i]};
            recv[i] = {base + layout.recv_offset[i], layout.recv_size[i]};
        }
        c.rank = r;
        world->ranks_[r]->transport = std::make_unique<MappedTransport>(r, peers, stage, recv);
        world->ranks_[r]->backend =
            std::make_unique<CpuBackend>(c, world->ranks_[r]->transport.get(), timeout);
    }
    return world;
}

Status LocalWorld::run(const std::function<Status(uint32_t, CpuBackend&)>& fn) {
    std::vector<Status> results(ranks_.size());
    std::vector<std::thread> threads;
    threads.reserve(ranks_.size());
    for (uint32_t r = 0; r < ranks_.size(); ++r)
        threads.emplace_back([&, r] { results[r] = fn(r, *ranks_[r]->backend); });
    for (auto& t : threads) t.join();
    for (uint32_t r = 0; r < results.size(); ++r)
        if (!results[r].ok()) return results[r].with_context(fmt::format("rank {}", r));
    return ok_status();
}

}  // namespace ferry::moe
