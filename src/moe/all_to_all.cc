#include "ferry/moe/all_to_all.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>

#include "ferry/common/bytes.h"
#include "ferry/moe/host_proxy.h"
#include "ferry/moe/transport.h"

namespace ferry::moe {
namespace {

constexpr uint32_t kSetupMagic = 0x4d6f4531;  // "MoE1"

// One POSIX shared-memory mapping. The creator unlinks the name once every peer has mapped
// it, so a crash later leaves nothing behind in /dev/shm.
class ShmSegment {
  public:
    ShmSegment() = default;
    ShmSegment(const ShmSegment&) = delete;
    ShmSegment& operator=(const ShmSegment&) = delete;
    ~ShmSegment() {
        if (base_) ::munmap(base_, size_);
        unlink();
    }

    static Result<std::unique_ptr<ShmSegment>> create(const std::string& name, size_t size) {
        auto seg = std::make_unique<ShmSegment>();
        int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0)
            return unavailable(fmt::format("shm_open({}) failed: {}", name, std::strerror(errno)));
        seg->name_ = name;
        seg->owner_ = true;
        if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
            int e = errno;
            ::close(fd);
            return resource_exhausted(
                fmt::format("sizing shared memory {} to {} bytes failed: "
                            "{} (is /dev/shm large enough?)",
                            name, size, std::strerror(e)));
        }
        FERRY_RETURN_IF_ERROR(seg->map(fd, size));
        return seg;
    }

    static Result<std::unique_ptr<ShmSegment>> open(const std::string& name, size_t size) {
        auto seg = std::make_unique<ShmSegment>();
        int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
        if (fd < 0)
            return unavailable(
                fmt::format("opening the shared memory {} of a same-node rank "
                            "failed: {}",
                            name, std::strerror(errno)));
        FERRY_RETURN_IF_ERROR(seg->map(fd, size));
        return seg;
    }

    void unlink() {
        if (owner_) ::shm_unlink(name_.c_str());
        owner_ = false;
    }
    uint8_t* data() const { return static_cast<uint8_t*>(base_); }

  private:
    Status map(int fd, size_t size) {
        void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        int e = errno;
        ::close(fd);
        if (p == MAP_FAILED)
            return unavailable(fmt::format("mmap of shared memory {} ({} bytes) failed: {}", name_,
                                           size, std::strerror(e)));
        base_ = p;
        size_ = size;
        return ok_status();
    }

    std::string name_;
    bool owner_ = false;
    void* base_ = nullptr;
    size_t size_ = 0;
};

// Same-node peers through mapped memory, the others through the host proxy.
class HybridTransport final : public MappedTransport {
  public:
    HybridTransport(uint32_t rank, std::vector<MappedPeer> peers,
                    std::span<uint8_t> stage[kNumRegions], std::span<uint8_t> recv[kNumRegions],
                    std::vector<bool> remote, HostProxy* proxy, const TransferEngine* engine)
        : MappedTransport(rank, std::move(peers), stage, recv),
          remote_(std::move(remote)),
          proxy_(proxy),
          engine_(engine) {}

    Status put(uint32_t peer, Region region, uint64_t dst_offset, uint64_t src_offset,
               uint64_t len) override {
        if (peer < remote_.size() && remote_[peer]) {
            FERRY_RETURN_IF_ERROR(check_put(peer, region, dst_offset, src_offset, len));
            return proxy_->enqueue({peer, region, dst_offset, src_offset, len});
        }
        return MappedTransport::put(peer, region, dst_offset, src_offset, len);
    }
    uint64_t arrivals_for(uint32_t from, uint64_t len) const override {
        return remote_[from] ? write_pieces(engine_->config(), engine_->num_rails(), len) : 1;
    }
    Status flush(TimePoint deadline) override { return proxy_->flush(deadline); }

  protected:
    Status health() const override { return proxy_->error(); }

  private:
    std::vector<bool> remote_;
    HostProxy* proxy_;
    const TransferEngine* engine_;
};

struct SetupBlob {
    uint64_t config_hash = 0;
    uint32_t rank = 0;
    int32_t num_rails = 0;
    uint64_t stripe_threshold = 0;
    uint64_t max_write_size = 0;
    std::string shm_name;
    EngineAddress address;
    MemoryDescriptor shared;

    std::vector<uint8_t> encode() const {
        ByteWriter w;
        w.put(kSetupMagic);
        w.put(config_hash);
        w.put(rank);
        w.put(num_rails);
        w.put(stripe_threshold);
        w.put(max_write_size);
        w.put_string(shm_name);
        address.encode(w);
        shared.encode(w);
        return w.take();
    }
    static Result<SetupBlob> decode(std::span<const uint8_t> blob) {
        ByteReader r(blob);
        SetupBlob b;
        uint32_t magic = 0;
        FERRY_RETURN_IF_ERROR(r.get(&magic, "moe setup magic"));
        if (magic != kSetupMagic)
            return protocol_error(
                fmt::format("MoE setup blob has magic {:#x}, expected {:#x}: "
                            "a peer runs an incompatible ferry build",
                            magic, kSetupMagic));
        FERRY_RETURN_IF_ERROR(r.get(&b.config_hash, "config hash"));
        FERRY_RETURN_IF_ERROR(r.get(&b.rank, "rank"));
        FERRY_RETURN_IF_ERROR(r.get(&b.num_rails, "num rails"));
        FERRY_RETURN_IF_ERROR(r.get(&b.stripe_threshold, "stripe threshold"));
        FERRY_RETURN_IF_ERROR(r.get(&b.max_write_size, "max write size"));
        FERRY_RETURN_IF_ERROR(r.get_string(&b.shm_name, "shm name", 256));
        FERRY_ASSIGN_OR_RETURN(b.address, EngineAddress::decode(r));
        FERRY_ASSIGN_OR_RETURN(b.shared, MemoryDescriptor::decode(r));
        return b;
    }
};

std::string unique_shm_name(uint32_t rank) {
    std::random_device rd;
    uint64_t token = (uint64_t{rd()} << 32) | rd();
    return fmt::format("/ferry-moe-{}-{}-{:016x}", ::getpid(), rank, token);
}

}  // namespace

struct AllToAll::Impl {
    struct Free {
        void operator()(uint8_t* p) const { std::free(p); }
    };
    AllToAllConfig cfg;
    TransferEngine* engine = nullptr;
    std::unique_ptr<ShmSegment> own;
    std::vector<std::unique_ptr<ShmSegment>> mapped;  // same-node peers
    std::unique_ptr<uint8_t, Free> stage;
    std::unique_ptr<MemoryRegion> shared_mr;
    std::unique_ptr<MemoryRegion> stage_mr;
    std::unique_ptr<HostProxy> proxy;
    std::unique_ptr<HybridTransport> transport;
    std::unique_ptr<CpuBackend> backend;

    ~Impl() {
        // The proxy first: it waits for its in-flight writes, which read the staging memory.
        if (proxy) proxy->stop();
        backend.reset();
        transport.reset();
        proxy.reset();
        stage_mr.reset();
        shared_mr.reset();
    }
};

AllToAll::AllToAll(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AllToAll::~AllToAll() = default;

Result<std::unique_ptr<AllToAll>> AllToAll::create(const AllToAllConfig& cfg,
                                                   TransferEngine* engine,
                                                   const AllGatherFn& allgather,
                                                   const AllToAllOptions& options) {
    FERRY_RETURN_IF_ERROR(cfg.validate());
    if (!engine) return invalid_argument("AllToAll::create: no TransferEngine given");
    auto impl = std::make_unique<Impl>();
    impl->cfg = cfg;
    impl->engine = engine;
    const uint32_t w = cfg.world_size;
    RankMemoryLayout layout = RankMemoryLayout::of(cfg);
    const size_t stage_bytes = layout.total_bytes - layout.shared_bytes;

    SetupBlob mine;
    mine.shm_name = unique_shm_name(cfg.rank);
    FERRY_ASSIGN_OR_RETURN(impl->own, ShmSegment::create(mine.shm_name, layout.shared_bytes));
    auto* stage = static_cast<uint8_t*>(std::aligned_alloc(4096, stage_bytes));
    if (!stage)
        return resource_exhausted(
            fmt::format("cannot allocate {} bytes of MoE staging", stage_bytes));
    impl->stage.reset(stage);
    std::memset(stage, 0, stage_bytes);
    FERRY_ASSIGN_OR_RETURN(impl->shared_mr,
                           engine->register_memory(impl->own->data(), layout.shared_bytes));
    FERRY_ASSIGN_OR_RETURN(impl->stage_mr, engine->register_memory(stage, stage_bytes));

    mine.config_hash = cfg.hash();
    mine.rank = cfg.rank;
    mine.num_rails = engine->num_rails();
    mine.stripe_threshold = engine->config().stripe_threshold;
    mine.max_write_size = engine->config().max_write_size;
    mine.address = engine->address();
    mine.shared = impl->shared_mr->descriptor();
    FERRY_ASSIGN_OR_RETURN(auto blobs, allgather(mine.encode()));
    if (blobs.size() != w)
        return invalid_argument(
            fmt::format("AllToAll setup: the exchange returned {} blobs for "
                        "a world of {}",
                        blobs.size(), w));
    std::vector<SetupBlob> all(w);
    std::vector<uint64_t> hashes(w);
    for (uint32_t r = 0; r < w; ++r) {
        if (blobs[r].empty()) return unavailable(fmt::format("AllToAll setup: rank {} is gone", r));
        auto b = SetupBlob::decode(blobs[r]);
        if (!b.ok()) return b.status().with_context(fmt::format("AllToAll setup: rank {}", r));
        all[r] = std::move(b).value();
        hashes[r] = all[r].config_hash;
        if (all[r].rank != r)
            return invalid_argument(
                fmt::format("AllToAll setup: the blob at index {} comes from "
                            "a rank that calls itself {}; give every rank a "
                            "distinct rank in [0, {})",
                            r, all[r].rank, w));
    }
    FERRY_RETURN_IF_ERROR(check_same_config(cfg, hashes));

    // Same-node peers: map their memory. Others: connect through the engine.
    std::vector<MappedPeer> peers(w);
    std::vector<bool> remote(w, false);
    HostProxy::Setup ps;
    ps.peers.resize(w);
    impl->mapped.resize(w);
    for (uint32_t r = 0; r < w; ++r) {
        const SetupBlob& b = all[r];
        if (r == cfg.rank) {
            peers[r] = layout.peer_view(impl->own->data(), w);
            continue;
        }
        if (cfg.same_node(r, cfg.rank)) {
            if (b.address.host_id != engine->address().host_id)
                return invalid_argument(fmt::format(
                    "AllToAll setup: ranks_per_node {} puts ranks {} and {} on one node, but "
                    "they run on different hosts; set ranks_per_node to the ranks per host",
                    cfg.ranks_per_node, cfg.rank, r));
            FERRY_ASSIGN_OR_RETURN(impl->mapped[r],
                                   ShmSegment::open(b.shm_name, layout.shared_bytes));
            peers[r] = layout.peer_view(impl->mapped[r]->data(), w);
            continue;
        }
        if (b.num_rails != engine->num_rails() ||
            b.stripe_threshold != engine->config().stripe_threshold ||
            b.max_write_size != engine->config().max_write_size)
            return invalid_argument(fmt::format(
                "AllToAll setup: rank {}'s engine splits writes differently (rails {}, stripe "
                "threshold {}, max write {}; here {}, {}, {}); receivers count write pieces, so "
                "every rank needs the same engine settings",
                r, b.num_rails, b.stripe_threshold, b.max_write_size, engine->num_rails(),
                engine->config().stripe_threshold, engine->config().max_write_size));
        remote[r] = true;
        FERRY_ASSIGN_OR_RETURN(ps.peers[r].peer, engine->connect(b.address));
        ps.peers[r].shared = b.shared;
        for (int g = 0; g < kNumRegions; ++g) ps.peers[r].recv_offset[g] = layout.recv_offset[g];
    }
    // Everyone has mapped everything: the names can go.
    FERRY_ASSIGN_OR_RETURN(auto done, allgather({}));
    if (done.size() != w) return unavailable("AllToAll setup: a rank left during setup");
    impl->own->unlink();

    std::span<uint8_t> stage_spans[kNumRegions], recv_spans[kNumRegions];
    for (int g = 0; g < kNumRegions; ++g) {
        size_t so = layout.stage_offset[g] - layout.shared_bytes;
        stage_spans[g] = {stage + so, layout.stage_size[g]};
        recv_spans[g] = {impl->own->data() + layout.recv_offset[g], layout.recv_size[g]};
        ps.stage_offset[g] = so;
    }
    ps.engine = engine;
    ps.rank = cfg.rank;
    ps.world = w;
    ps.imm_base = options.imm_base;
    ps.arrivals = peers[cfg.rank].arrivals;
    ps.stage = impl->stage_mr.get();
    ps.remote = remote;
    impl->proxy = std::make_unique<HostProxy>(std::move(ps));
    impl->transport =
        std::make_unique<HybridTransport>(cfg.rank, std::move(peers), stage_spans, recv_spans,
                                          std::move(remote), impl->proxy.get(), engine);
    impl->backend = std::make_unique<CpuBackend>(cfg, impl->transport.get(), options.timeout);
    impl->proxy->start();
    return std::unique_ptr<AllToAll>(new AllToAll(std::move(impl)));
}

const AllToAllConfig& AllToAll::config() const { return impl_->cfg; }
Status AllToAll::dispatch_send(const DispatchInput& in) {
    return impl_->backend->dispatch_send(in);
}
Status AllToAll::dispatch_recv(const ExpertBatch& out) {
    return impl_->backend->dispatch_recv(out);
}
Status AllToAll::combine_send(std::span<const uint16_t> expert_out) {
    return impl_->backend->combine_send(expert_out);
}
Status AllToAll::combine_recv(std::span<float> out) { return impl_->backend->combine_recv(out); }
Status AllToAll::combine_recv_bf16(std::span<uint16_t> out) {
    return impl_->backend->combine_recv_bf16(out);
}
Status AllToAll::set_combine_weights(std::span<const float> weights) {
    return impl_->backend->set_combine_weights(weights);
}
const std::vector<uint32_t>& AllToAll::sent_expert_counts() const {
    return impl_->backend->sent_expert_counts();
}
PhaseBytes AllToAll::last_bytes() const { return impl_->backend->last_bytes(); }

}  // namespace ferry::moe
