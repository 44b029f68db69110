// Shared pieces of the multi-process connector tests: one engine, KV pool, block pool and
// connector per child process, and a byte-exact model of what each request's KV holds.
#pragma once

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "ferry/common/bytes.h"
#include "ferry/fabric/engine.h"
#include "ferry/kv/block_pool.h"
#include "ferry/kv/connector.h"
#include "support/engine_fixture.h"
#include "support/multiproc.h"

namespace ferry::kv::testing {

// What the kv tests share; a test file takes it all with `using namespace testing;`.
using ::ferry::testing::Exchange;
using ::ferry::testing::run_processes;

inline constexpr uint8_t kPoison = 0xa5;
// A multi-process run as a whole, and one result within it.
inline constexpr auto kRunTimeout = std::chrono::seconds(150);
inline constexpr auto kWait = std::chrono::seconds(20);
// Process ranks of the one-prefill, one-decode runs.
inline constexpr int kPrefill = 0;
inline constexpr int kDecode = 1;

// Results delivered by the connector callbacks, waited for with a deadline.
class ResultLog {
  public:
    void add(bool send_side, const TransferResult& r);
    // The first result for (side, transfer id[, attempt]) not taken yet; kTimeout otherwise.
    Result<TransferResult> wait(bool send_side, uint64_t id, Duration timeout,
                                int64_t attempt = -1);
    size_t size() const;
    // Whether any result was delivered on thread `t`.
    bool delivered_on(std::thread::id t) const;

  private:
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::pair<bool, TransferResult>> items_;
    std::set<std::thread::id> threads_;
};

struct KvNode {
    KvRank self;
    std::unique_ptr<TransferEngine> engine;
    std::vector<uint8_t> mem;
    std::unique_ptr<MemoryRegion> mr;
    // A pool of several regions (layout.regions not kOne): region i registered on its own over
    // mem[i * region_bytes, (i + 1) * region_bytes), so `mem` still reads as the whole pool.
    // An offset taken in the wrong region lands elsewhere in `mem` or outside the region's
    // registration, and the byte checks or the engine's bounds checks catch it.
    std::vector<std::unique_ptr<MemoryRegion>> region_mrs;
    std::unique_ptr<BlockPool> blocks;
    ResultLog results;
    ResultLog scheduled;  // on_scheduled, logged as recv results
    ResultLog gave_up;    // on_send_cancelled, logged as send results
    std::unique_ptr<KvConnector> conn;
    // on_recv_progress: every reported prefix, per transfer, in order.
    std::mutex progress_mu;
    std::map<uint64_t, std::vector<uint32_t>> progress;
    // Largest partial_layers reported per transfer (a chunk pushed layer by layer).
    std::map<uint64_t, uint32_t> partial_layers;

    std::vector<uint32_t> progress_of(uint64_t id) {
        std::lock_guard lk(progress_mu);
        return progress[id];
    }
    std::vector<EngineAddress> addrs;  // every process's engine, by process rank

    ~KvNode() { conn.reset(); }
};

struct NodeOptions {
    std::string provider = "tcp";
    // The engine's: short, so that the tests of dead and lost peers end soon.
    Duration op_timeout = std::chrono::seconds(3);
    Duration lease = std::chrono::seconds(10);
    PullMode pull_mode = PullMode::kBackground;
    // The pool is registered as pool_remote_access(pull_keys) says (no peer reads under
    // kPerOffer).
    PullKeys pull_keys = PullKeys::kPerOffer;
    uint32_t imm_count = ConnectorConfig{}.imm_count;  // decode's immediates
    uint32_t imm_span = ConnectorConfig{}.imm_span;
};

// Engine, pool (filled with `fill`), a block pool whose ids come out in a random order, the
// connector, and every process's engine address.
Result<std::unique_ptr<KvNode>> make_kv_node(::ferry::testing::Exchange& ex, const KvRank& self,
                                             const NodeOptions& opt, uint64_t seed, uint8_t fill);

// The value of every KV byte of a request: derived from (transfer id, layer, K/V, token,
// global head, byte in head), so any misplaced byte is caught.
uint8_t kv_byte(uint64_t id, uint32_t layer, KvPart part, uint32_t token, uint32_t ghead,
                uint32_t byte);

// Writes the request's KV into a producer pool.
void fill_request(KvNode& n, uint64_t id, const std::vector<uint32_t>& blocks, uint32_t tokens);
// Waits until the connector received at least `count` messages: lets a test put a REGISTER
// before prefill_done for real, not just in the order of the calls.
Status wait_messages(KvNode& n, uint64_t count, Duration timeout);
// Waits until on_recv_progress reported at least `tokens` of transfer `id` in place.
Status wait_progress(KvNode& n, uint64_t id, uint32_t tokens, Duration timeout);
// Pool accounting and connector state after a test: nothing held, nothing leaked.
std::string check_no_leak(KvNode& n);
// For a test that kills its own process: the shm provider names its regions after the pid and
// a killed process leaves them behind, so a later process that gets the same pid fails to open
// an endpoint (EBUSY). Removing the names first keeps the mappings peers hold and spares the
// next tests; it does not change what the peers observe.
void drop_shm_names_of_this_process();
// Writes the request's expected KV into an image of the consumer pool.
void expect_request(const KvRank& self, std::vector<uint8_t>& image, uint64_t id,
                    const std::vector<uint32_t>& blocks, uint32_t tokens);
// "" when equal, else a count and the first mismatches.
std::string compare_pool(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want);

KvLayout test_layout(uint32_t heads_per_rank, uint32_t block_size, BlockOrder order,
                     KvPlacement placement, uint32_t num_blocks);

// ---- definitions (header only: the test glob builds *_test.cc files alone) ----

inline void ResultLog::add(bool send_side, const TransferResult& r) {
    {
        std::lock_guard lk(mu_);
        items_.emplace_back(send_side, r);
        threads_.insert(std::this_thread::get_id());
    }
    cv_.notify_all();
}

inline Result<TransferResult> ResultLog::wait(bool send_side, uint64_t id, Duration timeout,
                                              int64_t attempt) {
    std::unique_lock lk(mu_);
    TimePoint deadline = Clock::now() + timeout;
    while (true) {
        for (auto it = items_.begin(); it != items_.end(); ++it) {
            if (it->first == send_side && it->second.transfer_id == id &&
                (attempt < 0 || it->second.attempt == static_cast<uint32_t>(attempt))) {
                TransferResult r = it->second;
                items_.erase(it);
                return r;
            }
        }
        if (cv_.wait_until(lk, deadline) == std::cv_status::timeout) {
            return timeout_error(fmt::format("no {} result for transfer {:x} after {:.0f} ms",
                                             send_side ? "send" : "recv", id, to_ms(timeout)));
        }
    }
}

inline size_t ResultLog::size() const {
    std::lock_guard lk(mu_);
    return items_.size();
}

inline bool ResultLog::delivered_on(std::thread::id t) const {
    std::lock_guard lk(mu_);
    return threads_.count(t) > 0;
}

inline Result<std::unique_ptr<KvNode>> make_kv_node(::ferry::testing::Exchange& ex,
                                                    const KvRank& self, const NodeOptions& opt,
                                                    uint64_t seed, uint8_t fill) {
    auto n = std::make_unique<KvNode>();
    n->self = self;
    EngineConfig ec = ::ferry::testing::test_engine_config(opt.provider);
    ec.op_timeout = opt.op_timeout;
    FERRY_ASSIGN_OR_RETURN(n->engine, TransferEngine::create(ec));
    n->mem.assign(self.layout.pool_bytes(), fill);
    const RemoteAccess access = pool_remote_access(opt.pull_keys, MemoryKind::kHost);
    FERRY_ASSIGN_OR_RETURN(n->mr, n->engine->register_memory(n->mem.data(), n->mem.size(),
                                                             MemoryKind::kHost, -1, access));
    n->blocks = std::make_unique<BlockPool>(self.layout.num_blocks);
    {
        // Scramble the free list so that requests get scattered, non-monotonic block ids.
        auto all = n->blocks->allocate(self.layout.num_blocks);
        if (!all.ok()) return all.status();
        std::mt19937_64 rng(seed ^ (uint64_t{static_cast<uint32_t>(ex.rank())} << 40));
        std::shuffle(all->begin(), all->end(), rng);
        FERRY_RETURN_IF_ERROR(n->blocks->free(*all));
    }
    ConnectorConfig cc;
    cc.self = self;
    cc.lease = opt.lease;
    cc.pull_mode = opt.pull_mode;
    cc.pull_keys = opt.pull_keys;
    cc.imm_count = opt.imm_count;
    cc.imm_span = opt.imm_span;
    KvNode* raw = n.get();
    ConnectorCallbacks cb;
    cb.on_recv_done = [raw](const TransferResult& r) { raw->results.add(false, r); };
    cb.on_send_done = [raw](const TransferResult& r) { raw->results.add(true, r); };
    cb.on_scheduled = [raw](const TransferResult& r) { raw->scheduled.add(false, r); };
    cb.on_send_cancelled = [raw](const TransferResult& r) { raw->gave_up.add(true, r); };
    cb.on_recv_progress = [raw](const TransferProgress& p) {
        std::lock_guard lk(raw->progress_mu);
        if (raw->progress[p.transfer_id].empty() || raw->progress[p.transfer_id].back() != p.tokens)
            raw->progress[p.transfer_id].push_back(p.tokens);
        if (p.partial_layers > 0)
            raw->partial_layers[p.transfer_id] =
                std::max(raw->partial_layers[p.transfer_id], p.partial_layers);
    };
    if (self.layout.regions == RegionSplit::kOne) {
        FERRY_ASSIGN_OR_RETURN(n->conn, KvConnector::create(n->engine.get(), n->mr.get(), cc, cb));
    } else {
        KvPoolRegions pool;
        const uint64_t rb = self.layout.region_bytes();
        for (uint32_t i = 0; i < self.layout.region_count(); ++i) {
            FERRY_ASSIGN_OR_RETURN(
                auto r, n->engine->register_memory(n->mem.data() + i * rb, rb, MemoryKind::kHost,
                                                   -1, access));
            pool.regions.push_back(r.get());
            n->region_mrs.push_back(std::move(r));
        }
        FERRY_ASSIGN_OR_RETURN(n->conn, KvConnector::create(n->engine.get(), pool, cc, cb));
    }
    FERRY_ASSIGN_OR_RETURN(auto all, ex.allgather(n->engine->address().serialize()));
    for (int r = 0; r < ex.size(); ++r) {
        if (all[r].empty()) return unavailable(fmt::format("rank {} is gone", r));
        FERRY_ASSIGN_OR_RETURN(auto a, EngineAddress::deserialize(all[r]));
        n->addrs.push_back(std::move(a));
    }
    return n;
}

inline uint8_t kv_byte(uint64_t id, uint32_t layer, KvPart part, uint32_t token, uint32_t ghead,
                       uint32_t byte) {
    uint64_t x = id * 0x9e3779b97f4a7c15ull;
    x ^= (uint64_t{layer} << 52) ^ (uint64_t{static_cast<uint8_t>(part)} << 50) ^
         (uint64_t{token} << 24) ^ (uint64_t{ghead} << 12) ^ byte;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    return static_cast<uint8_t>(x >> 56);
}

// The request's bytes of tokens [first_token, end_token) in layers [first_layer, end_layer).
inline void expect_request_part(const KvRank& self, std::vector<uint8_t>& image, uint64_t id,
                                const std::vector<uint32_t>& blocks, uint32_t first_token,
                                uint32_t end_token, uint32_t first_layer, uint32_t end_layer) {
    const KvLayout& l = self.layout;
    for (uint32_t layer = first_layer; layer < std::min(end_layer, l.num_layers); ++layer)
        for (KvPart part : {KvPart::kK, KvPart::kV})
            for (uint32_t t = first_token; t < end_token; ++t)
                for (uint32_t h = 0; h < l.num_kv_heads; ++h) {
                    uint64_t off =
                        l.offset(layer, part, blocks[t / l.block_size], t % l.block_size, h);
                    for (uint32_t b = 0; b < l.head_bytes(); ++b) {
                        image[off + b] = kv_byte(id, layer, part, t, self.first_head() + h, b);
                    }
                }
}

inline void expect_request(const KvRank& self, std::vector<uint8_t>& image, uint64_t id,
                           const std::vector<uint32_t>& blocks, uint32_t tokens) {
    expect_request_part(self, image, id, blocks, 0, tokens, 0, self.layout.num_layers);
}

inline void fill_request(KvNode& n, uint64_t id, const std::vector<uint32_t>& blocks,
                         uint32_t tokens) {
    expect_request(n.self, n.mem, id, blocks, tokens);
}

inline Status wait_progress(KvNode& n, uint64_t id, uint32_t tokens, Duration timeout) {
    TimePoint deadline = Clock::now() + timeout;
    while (true) {
        auto p = n.progress_of(id);
        if (!p.empty() && p.back() >= tokens) return ok_status();
        if (Clock::now() > deadline) {
            return timeout_error(fmt::format("transfer {:x}: {} tokens reported in place, want {}",
                                             id, p.empty() ? 0 : p.back(), tokens));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
}

inline Status wait_messages(KvNode& n, uint64_t count, Duration timeout) {
    TimePoint deadline = Clock::now() + timeout;
    while (n.conn->stats().messages_received < count) {
        if (Clock::now() > deadline) {
            return timeout_error(
                fmt::format("{} of {} messages arrived", n.conn->stats().messages_received, count));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return ok_status();
}

inline std::string check_no_leak(KvNode& n) {
    CHILD_CHECK_MSG(n.blocks->free_count() == n.blocks->num_blocks(), "{} blocks leaked",
                    n.blocks->used_count());
    ConnectorStats s = n.conn->stats();
    CHILD_CHECK_MSG(s.active_send == 0 && s.active_recv == 0,
                    "connector still holds {} send, {} recv transfers", s.active_send,
                    s.active_recv);
    return "";
}

inline void drop_shm_names_of_this_process() {
    std::error_code ec;
    std::string prefix = std::to_string(::getpid()) + ":";
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
        std::string name = e.path().filename().string();
        if (name.rfind(prefix, 0) == 0) ::shm_unlink(("/" + name).c_str());
    }
}

inline std::string compare_pool(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
    if (got.size() != want.size()) return "pool sizes differ";
    size_t bad = 0;
    std::string out;
    for (size_t i = 0; i < got.size(); ++i) {
        if (got[i] != want[i]) {
            if (bad < 4) out += fmt::format("byte {}: got {:#x} want {:#x}; ", i, got[i], want[i]);
            ++bad;
        }
    }
    if (bad) out += fmt::format("{} of {} bytes wrong", bad, got.size());
    return out;
}

// What is wrong in decode's pool (poisoned before the transfer) if it does not hold exactly one
// request's KV in its blocks and the poison everywhere else; empty when it does.
inline std::string pool_holds_only(KvNode& n, uint64_t id, const std::vector<uint32_t>& blocks,
                                   uint32_t tokens) {
    std::vector<uint8_t> image(n.mem.size(), kPoison);
    expect_request(n.self, image, id, blocks, tokens);
    return compare_pool(n.mem, image);
}

inline KvLayout test_layout(uint32_t heads_per_rank, uint32_t block_size, BlockOrder order,
                            KvPlacement placement, uint32_t num_blocks) {
    KvLayout l;
    l.num_layers = 3;
    l.num_kv_heads = heads_per_rank;
    l.head_dim = 16;
    l.elem_size = 2;
    l.block_size = block_size;
    l.num_blocks = num_blocks;
    l.order = order;
    l.placement = placement;
    return l;
}

}  // namespace ferry::kv::testing
