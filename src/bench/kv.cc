#include "bench/kv.h"

#include <fmt/format.h>
#include <time.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

#include "bench/limits.h"
#include "bench/xfer.h"
#include "ferry/fabric/engine.h"
#include "ferry/fabric/gpu_memory.h"
#include "ferry/kv/block_pool.h"
#include "ferry/kv/connector.h"

namespace ferry::kv {
namespace {

const Duration kWait = std::chrono::seconds(120);

// Completion times of transfers, by (side, id).
class Completions {
  public:
    void add(bool send, const TransferResult& r) {
        {
            std::lock_guard lk(mu_);
            done_[{send, r.transfer_id}].push_back({Clock::now(), r.status});
        }
        cv_.notify_all();
    }
    // Waits for n results of (side, id); returns the latest completion time.
    Result<TimePoint> wait(bool send, uint64_t id, size_t n) {
        std::unique_lock lk(mu_);
        auto key = std::make_pair(send, id);
        if (!cv_.wait_for(lk, kWait, [&] { return done_[key].size() >= n; })) {
            return timeout_error(fmt::format("bench: transfer {} did not finish", id));
        }
        TimePoint last{};
        for (const auto& [t, s] : done_[key]) {
            if (!s.ok()) return s.with_context(fmt::format("bench transfer {}", id));
            last = std::max(last, t);
        }
        done_.erase(key);
        return last;
    }

  private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::map<std::pair<bool, uint64_t>, std::vector<std::pair<TimePoint, Status>>> done_;
};

constexpr uint8_t kPoison = 0xCD;

void fill_pattern(std::vector<uint8_t>& b, uint32_t rank) {
    uint64_t x = 0x9E3779B97F4A7C15ull * (rank + 1);
    for (size_t i = 0; i < b.size(); i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::memcpy(b.data() + i, &x, std::min<size_t>(8, b.size() - i));
    }
}

struct Rank {
    KvRank self;
    std::unique_ptr<TransferEngine> engine;
    std::vector<uint8_t> mem;
    GpuBuffer gmem;  // the pool, when it lives on a GPU
    std::unique_ptr<MemoryRegion> mr;
    std::vector<std::unique_ptr<MemoryRegion>> region_mrs;  // a pool of several regions
    std::unique_ptr<BlockPool> blocks;
    std::unique_ptr<KvConnector> conn;
    ~Rank() {
        conn.reset();
        region_mrs.clear();
        mr.reset();
    }
};

double thread_cpu_us() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}

double percentile(std::vector<double> v, double p) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    size_t i = static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
    return v[std::min(i, v.size() - 1)];
}

class Bench {
  public:
    explicit Bench(const KvBenchConfig& c) : c_(c) {}

    Status setup() {
        uint32_t max_tokens = *std::max_element(c_.tokens.begin(), c_.tokens.end());
        auto make = [&](uint32_t tp, uint32_t r, bool prefill) -> Result<std::unique_ptr<Rank>> {
            auto rank = std::make_unique<Rank>();
            KvLayout l;
            l.num_layers = c_.layers;
            l.num_kv_heads = c_.kv_heads / tp;
            l.head_dim = c_.head_dim;
            l.elem_size = c_.elem_size;
            l.block_size = c_.block_size;
            // Room for one request of the largest size, plus slack for scattering.
            l.num_blocks = blocks_for_tokens(max_tokens, c_.block_size) * 5 / 4 + 4;
            l.regions = prefill ? c_.regions_prefill : c_.regions_decode;
            rank->self = {l, r, tp};
            EngineConfig ec;
            ec.provider = c_.provider;
            ec.peers_on_same_host = true;
            ec.op_timeout = std::chrono::seconds(60);
            ec.busy_poll = c_.busy_poll;
            if (c_.max_write_size) ec.max_write_size = c_.max_write_size;
            FERRY_ASSIGN_OR_RETURN(rank->engine, TransferEngine::create(ec));
            // Prefill pools hold a pattern every byte of which differs by offset and rank;
            // decode pools start poisoned, so a byte that was not written is caught.
            std::vector<uint8_t> init(l.pool_bytes(), kPoison);
            if (prefill) fill_pattern(init, r);
            if (c_.gpu) {
                int n = gpu_device_count();
                int dev = prefill || n < 2 ? 0 : 1;
                FERRY_ASSIGN_OR_RETURN(rank->gmem, GpuBuffer::allocate(init.size(), dev));
                FERRY_RETURN_IF_ERROR(rank->gmem.copy_from_host(init.data(), init.size()));
                FERRY_ASSIGN_OR_RETURN(rank->mr,
                                       rank->engine->register_memory(rank->gmem.data(), init.size(),
                                                                     MemoryKind::kCuda, dev));
            } else {
                rank->mem = std::move(init);
                FERRY_ASSIGN_OR_RETURN(
                    rank->mr, rank->engine->register_memory(
                                  rank->mem.data(), rank->mem.size(), MemoryKind::kHost, -1,
                                  pool_remote_access(c_.pull_keys, MemoryKind::kHost)));
            }
            rank->blocks = std::make_unique<BlockPool>(l.num_blocks);
            if (c_.random_blocks) {
                FERRY_ASSIGN_OR_RETURN(auto all, rank->blocks->allocate(l.num_blocks));
                std::mt19937_64 rng(r * 7919 + tp);
                std::shuffle(all.begin(), all.end(), rng);
                FERRY_RETURN_IF_ERROR(rank->blocks->free(all));
            }
            ConnectorConfig cc;
            cc.self = rank->self;
            cc.lease = std::chrono::seconds(120);
            cc.pull_mode = c_.mode == "pull-inline" ? PullMode::kInline : PullMode::kBackground;
            cc.run_on_caller = c_.run_on_caller;
            cc.pull_keys = c_.pull_keys;
            ConnectorCallbacks cb;
            cb.on_recv_done = [this](const TransferResult& t) { done_.add(false, t); };
            cb.on_send_done = [this](const TransferResult& t) { done_.add(true, t); };
            // A pool of several regions is registered region by region, as an engine with one
            // tensor per layer (or per layer and K/V) registers it.
            KvPoolRegions pool = KvPoolRegions::one(rank->mr.get());
            if (l.regions != RegionSplit::kOne) {
                rank->mr.reset();
                pool.regions.clear();
                uint8_t* base =
                    c_.gpu ? static_cast<uint8_t*>(rank->gmem.data()) : rank->mem.data();
                for (uint32_t i = 0; i < l.region_count(); ++i) {
                    uint8_t* at = base + i * l.region_bytes();
                    int dev = prefill || gpu_device_count() < 2 ? 0 : 1;
                    FERRY_ASSIGN_OR_RETURN(
                        auto mr, c_.gpu ? rank->engine->register_memory(at, l.region_bytes(),
                                                                        MemoryKind::kCuda, dev)
                                        : rank->engine->register_memory(
                                              at, l.region_bytes(), MemoryKind::kHost, -1,
                                              pool_remote_access(c_.pull_keys, MemoryKind::kHost)));
                    pool.regions.push_back(mr.get());
                    rank->region_mrs.push_back(std::move(mr));
                }
            }
            FERRY_ASSIGN_OR_RETURN(rank->conn,
                                   KvConnector::create(rank->engine.get(), pool, cc, cb));
            return rank;
        };
        for (uint32_t r = 0; r < c_.tp_prefill; ++r) {
            FERRY_ASSIGN_OR_RETURN(auto p, make(c_.tp_prefill, r, true));
            prefill_.push_back(std::move(p));
        }
        for (uint32_t r = 0; r < c_.tp_decode; ++r) {
            FERRY_ASSIGN_OR_RETURN(auto d, make(c_.tp_decode, r, false));
            decode_.push_back(std::move(d));
        }
        for (auto& p : prefill_) prefill_addrs_.push_back(p->engine->address());
        return ok_status();
    }

    Result<KvBenchRow> run_point(uint32_t tokens) {
        KvBenchRow row;
        row.mode = c_.mode;
        row.tokens = tokens;
        std::vector<double> lat_ms, caller_us, caller_cpu;
        // One untimed warm-up: connections, first touches of the pools.
        for (int it = -1; it < c_.iters; ++it) {
            uint64_t id = next_id_++;
            FERRY_ASSIGN_OR_RETURN(auto sample, one_request(id, tokens, &row, it < 0 && c_.verify));
            if (it < 0) continue;
            lat_ms.push_back(sample.latency_ms);
            caller_us.push_back(sample.caller_us);
            caller_cpu.push_back(sample.caller_cpu_us);
        }
        row.p50_ms = percentile(lat_ms, 0.5);
        row.p99_ms = percentile(lat_ms, 0.99);
        row.gbps = row.p50_ms > 0 ? static_cast<double>(row.bytes) / (row.p50_ms * 1e6) : 0;
        row.caller_us_p50 = percentile(caller_us, 0.5);
        row.caller_us_p99 = percentile(caller_us, 0.99);
        row.caller_cpu_us_p50 = percentile(caller_cpu, 0.5);
        return row;
    }

  private:
    struct Sample {
        double latency_ms;
        double caller_us;      // wall time in the busiest rank's calls
        double caller_cpu_us;  // CPU time of those calls: the same without preemption
    };
    // The pool's bytes as the host sees them.
    Result<std::vector<uint8_t>> pool_bytes(const Rank& r) {
        if (!c_.gpu) return r.mem;
        std::vector<uint8_t> b(r.gmem.size());
        FERRY_RETURN_IF_ERROR(r.gmem.copy_to_host(b.data(), b.size()));
        return b;
    }

    // Every byte each plan says must have moved did move.
    Status verify(uint64_t id, const std::vector<std::vector<uint32_t>>& pblocks,
                  const std::vector<std::vector<uint32_t>>& dblocks, uint32_t tokens) {
        for (size_t d = 0; d < decode_.size(); ++d) {
            FERRY_ASSIGN_OR_RETURN(auto got, pool_bytes(*decode_[d]));
            for (size_t p = 0; p < prefill_.size(); ++p) {
                FERRY_ASSIGN_OR_RETURN(auto src, pool_bytes(*prefill_[p]));
                FERRY_ASSIGN_OR_RETURN(
                    auto plan, plan_transfer({prefill_[p]->self, pblocks[p], decode_[d]->self,
                                              dblocks[d], 0, tokens}));
                // Run offsets are inside the regions the plan's groups name.
                const uint64_t srb = prefill_[p]->self.layout.region_bytes();
                const uint64_t drb = decode_[d]->self.layout.region_bytes();
                for (const RegionRuns& g : plan.groups) {
                    for (size_t i = g.first; i < g.first + g.count; ++i) {
                        const ByteRun& run = plan.runs[i];
                        uint64_t dst = g.dst_region * drb + run.dst_offset;
                        uint64_t src_at = g.src_region * srb + run.src_offset;
                        if (std::memcmp(got.data() + dst, src.data() + src_at, run.length) != 0) {
                            return internal_error(fmt::format(
                                "bench transfer {}: decode rank {} holds wrong KV bytes in the run "
                                "of {} bytes at pool offset {} (from prefill rank {})",
                                id, d, run.length, dst, p));
                        }
                    }
                }
            }
        }
        if (c_.progress) {
            c_.progress(fmt::format("verified every KV byte of a {}-token request", tokens));
        }
        return ok_status();
    }

    Result<Sample> one_request(uint64_t id, uint32_t tokens, KvBenchRow* row, bool check) {
        std::vector<std::vector<uint32_t>> pblocks, dblocks;
        for (auto& p : prefill_) {
            FERRY_ASSIGN_OR_RETURN(auto b,
                                   p->blocks->allocate(blocks_for_tokens(tokens, c_.block_size)));
            pblocks.push_back(std::move(b));
        }
        for (auto& d : decode_) {
            FERRY_ASSIGN_OR_RETURN(auto b,
                                   d->blocks->allocate(blocks_for_tokens(tokens, c_.block_size)));
            dblocks.push_back(std::move(b));
        }
        row->bytes = 0;
        row->descriptors = 0;
        for (size_t p = 0; p < prefill_.size(); ++p) {
            for (size_t d = 0; d < decode_.size(); ++d) {
                FERRY_ASSIGN_OR_RETURN(
                    auto plan, plan_transfer({prefill_[p]->self, pblocks[p], decode_[d]->self,
                                              dblocks[d], 0, tokens}));
                row->bytes += plan.bytes;
                // Between GPUs of this host the connector posts one block copy (the kernel
                // finds every run itself); otherwise one descriptor per run.
                row->descriptors += c_.gpu ? 1 : plan.descriptor_count();
            }
        }
        std::vector<double> caller(prefill_.size() + decode_.size(), 0);
        std::vector<double> caller_cpu(caller.size(), 0);
        auto timed = [&](size_t slot, auto&& fn) {
            double cpu0 = thread_cpu_us();
            TimePoint t = Clock::now();
            auto r = fn();
            caller[slot] += to_us(Clock::now() - t);
            caller_cpu[slot] += thread_cpu_us() - cpu0;
            return r;
        };
        TimePoint t0;
        if (c_.mode == "push") {
            uint64_t regs_before = 0;
            for (auto& p : prefill_) regs_before += p->conn->stats().messages_received;
            for (size_t d = 0; d < decode_.size(); ++d) {
                FERRY_RETURN_IF_ERROR(timed(prefill_.size() + d, [&] {
                    return decode_[d]->conn->register_push(
                        {id, 1, prefill_addrs_, dblocks[d], tokens});
                }));
            }
            // Push registers while prefill computes: let the REGISTERs land first.
            uint64_t expect = 0;
            for (size_t p = 0; p < prefill_.size(); ++p) {
                FERRY_ASSIGN_OR_RETURN(
                    auto readers, consumers_for_producer(c_.kv_heads, c_.tp_prefill, c_.tp_decode,
                                                         static_cast<uint32_t>(p)));
                expect += readers.size();
            }
            TimePoint deadline = Clock::now() + kWait;
            while (true) {
                uint64_t got = 0;
                for (auto& p : prefill_) got += p->conn->stats().messages_received;
                if (got >= regs_before + expect) break;
                if (Clock::now() > deadline) return timeout_error("bench: REGISTER never arrived");
                std::this_thread::sleep_for(std::chrono::microseconds(50));
            }
            // The count goes up as handling begins: give prefill's connector the time to finish
            // with the REGISTERs, as its compute would in serving (milliseconds at least).
            // Without it prefill_done was queued behind the REGISTER's handling instead of
            // running on the caller's thread (~11 us of a 16k-token push, H200 host 2026-12-03).
            std::this_thread::sleep_for(std::chrono::microseconds(c_.settle_us));
            t0 = Clock::now();
            for (size_t p = 0; p < prefill_.size(); ++p) {
                FERRY_RETURN_IF_ERROR(timed(
                    p, [&] { return prefill_[p]->conn->prefill_done(id, pblocks[p], tokens); }));
            }
        } else {
            t0 = Clock::now();
            std::vector<PullParamsMsg> params;
            for (size_t p = 0; p < prefill_.size(); ++p) {
                auto offer =
                    timed(p, [&] { return prefill_[p]->conn->offer_pull(id, pblocks[p], tokens); });
                if (!offer.ok()) return offer.status();
                params.push_back(std::move(*offer));
            }
            if (c_.offer_wait_ms > 0) {
                const TimePoint offered = Clock::now();
                std::this_thread::sleep_for(std::chrono::milliseconds(c_.offer_wait_ms));
                t0 += Clock::now() - offered;
            }
            for (size_t d = 0; d < decode_.size(); ++d) {
                FERRY_RETURN_IF_ERROR(timed(prefill_.size() + d, [&] {
                    return decode_[d]->conn->pull(id, params, dblocks[d], tokens);
                }));
            }
        }
        FERRY_ASSIGN_OR_RETURN(TimePoint t1, done_.wait(false, id, decode_.size()));
        FERRY_ASSIGN_OR_RETURN(TimePoint t2, done_.wait(true, id, prefill_.size()));
        (void)t2;
        if (check) FERRY_RETURN_IF_ERROR(verify(id, pblocks, dblocks, tokens));
        for (size_t p = 0; p < prefill_.size(); ++p) {
            FERRY_RETURN_IF_ERROR(prefill_[p]->blocks->free(pblocks[p]));
        }
        for (size_t d = 0; d < decode_.size(); ++d) {
            FERRY_RETURN_IF_ERROR(decode_[d]->blocks->free(dblocks[d]));
        }
        return Sample{to_ms(t1 - t0), *std::max_element(caller.begin(), caller.end()),
                      *std::max_element(caller_cpu.begin(), caller_cpu.end())};
    }

    KvBenchConfig c_;
    Completions done_;
    std::vector<std::unique_ptr<Rank>> prefill_, decode_;
    std::vector<EngineAddress> prefill_addrs_;
    uint64_t next_id_ = 1;
};

}  // namespace

Result<KvBenchReport> run_kv_bench(const KvBenchConfig& c) {
    if (c.mode != "push" && c.mode != "pull" && c.mode != "pull-inline") {
        return invalid_argument(
            fmt::format("bench kv: unknown mode '{}' (push, pull, "
                        "pull-inline)",
                        c.mode));
    }
    for (auto [flag, v] : {std::pair<const char*, uint64_t>{"--layers", c.layers},
                           {"--kv-heads", c.kv_heads},
                           {"--head-dim", c.head_dim},
                           {"--elem-size", c.elem_size},
                           {"--block-size", c.block_size}}) {
        // --block-size 0 divided by zero (SIGFPE); the others failed later as "cannot
        // register 0 bytes".
        if (v == 0) return invalid_argument(fmt::format("bench kv: {} must be at least 1", flag));
    }
    for (uint32_t t : c.tokens)
        if (t == 0) return invalid_argument("bench kv: --tokens: every count must be at least 1");
    if (c.tokens.empty()) return invalid_argument("bench kv: give at least one token count");
    // --max-write 1 made every byte its own write: minutes per request, measuring nothing a
    // deployment does. A page is the smallest piece a provider moves efficiently.
    if (c.max_write_size != 0 && c.max_write_size < kMinBenchMaxWrite)
        return invalid_argument(
            fmt::format("bench kv: --max-write {} is below {} bytes (0: the engine's default, {})",
                        c.max_write_size, kMinBenchMaxWrite, EngineConfig{}.max_write_size));
    FERRY_RETURN_IF_ERROR(bench::check_bench_range("kv", "--iters", c.iters, 1, bench::kMaxIters));
    FERRY_RETURN_IF_ERROR(
        bench::check_bench_range("kv", "--tp-prefill", c.tp_prefill, 1, bench::kMaxRanks));
    FERRY_RETURN_IF_ERROR(
        bench::check_bench_range("kv", "--tp-decode", c.tp_decode, 1, bench::kMaxRanks));
    if (c.tp_prefill == 0 || c.tp_decode == 0 || c.kv_heads % c.tp_prefill ||
        c.kv_heads % c.tp_decode) {
        return invalid_argument(fmt::format("bench kv: {} KV heads do not split over TP {} and {}",
                                            c.kv_heads, c.tp_prefill, c.tp_decode));
    }
    {
        // Each side's pools hold the largest request and a quarter more (Bench::setup), in
        // memory of this process; checked in doubles, before any product can wrap.
        const double max_tokens = *std::max_element(c.tokens.begin(), c.tokens.end());
        const double blocks = std::ceil(max_tokens / c.block_size) * 5 / 4 + 4;
        const double side =
            blocks * c.block_size * c.layers * 2.0 * c.kv_heads * c.head_dim * c.elem_size;
        FERRY_RETURN_IF_ERROR(bench::check_bench_memory(
            "kv",
            fmt::format("the prefill and decode pools for --tokens {:.0f} x --layers {} x "
                        "--kv-heads {} x --head-dim {} x --elem-size {} (K and V)",
                        max_tokens, c.layers, c.kv_heads, c.head_dim, c.elem_size),
            2 * side));
    }
    KvBenchReport rep;
    EngineConfig ec;
    ec.provider = c.provider;
    ec.peers_on_same_host = true;
    FERRY_ASSIGN_OR_RETURN(rep.provider, resolve_provider(ec));
    {
        // A provider that is not there fails here in milliseconds; found by the ceiling's
        // target instead, it cost 30 s of filling a 1 GiB region first.
        FERRY_ASSIGN_OR_RETURN(auto probe, TransferEngine::create(ec));
        (void)probe;
    }
    if (c.gpu && c.measure_ceiling) {
        int n = gpu_device_count();
        FERRY_ASSIGN_OR_RETURN(rep.ceiling_gbps,
                               measure_gpu_copy_ceiling(0, n > 1 ? 1 : 0, 256ull << 20, 10));
        rep.provider += " + CUDA IPC";
        if (c.progress) {
            c.progress(fmt::format("GPU-to-GPU copy ceiling: {:.1f} GB/s", rep.ceiling_gbps));
        }
    } else if (c.measure_ceiling) {
        XferBenchConfig xc;
        xc.provider = c.provider;
        xc.sizes = {1 << 20};
        // Over a region as large as the biggest request (capped at 1 GiB): the KV streams
        // from DRAM, so must the ceiling (four rotating 1 MiB buffers stay in cache and read
        // about twice as fast on shm).
        uint32_t max_tokens = *std::max_element(c.tokens.begin(), c.tokens.end());
        uint64_t req = uint64_t{max_tokens} * c.layers * 2 * c.kv_heads * c.head_dim * c.elem_size;
        xc.region_bytes = std::min<uint64_t>(req, 1ull << 30);
        xc.pages = {};
        xc.latency_iters = 200;
        xc.yardsticks = false;  // the ceiling is the raw rows'; Python's yardsticks are not asked
        FERRY_ASSIGN_OR_RETURN(auto xr, run_xfer_bench(xc));
        for (const auto& r : xr.rows) rep.ceiling_gbps = std::max(rep.ceiling_gbps, r.raw_gbps);
        if (c.progress) c.progress(fmt::format("raw ceiling: {:.2f} GB/s", rep.ceiling_gbps));
    }
    Bench b(c);
    FERRY_RETURN_IF_ERROR(b.setup());
    for (uint32_t t : c.tokens) {
        FERRY_ASSIGN_OR_RETURN(auto row, b.run_point(t));
        if (c.progress) {
            c.progress(fmt::format("{} {} tokens: p50 {:.2f} ms, {:.2f} GB/s, caller {:.1f} us",
                                   row.mode, t, row.p50_ms, row.gbps, row.caller_us_p50));
        }
        rep.rows.push_back(row);
    }
    return rep;
}

std::string format_kv_table(const KvBenchConfig& c, const KvBenchReport& r) {
    std::string s = fmt::format(
        "ferry bench kv: provider {}, {} layers x {} KV heads x {} dim x {} B, block {}, "
        "TP {}->{}, {} blocks, {} iterations, regions {}->{}\n",
        r.provider, c.layers, c.kv_heads, c.head_dim, c.elem_size, c.block_size, c.tp_prefill,
        c.tp_decode, c.random_blocks ? "scattered" : "consecutive", c.iters,
        region_split_name(c.regions_prefill), region_split_name(c.regions_decode));
    s += c.gpu
             ? fmt::format("GPU-to-GPU copy ceiling (cudaMemcpyPeerAsync, 256 MiB): {:.2f} GB/s\n",
                           r.ceiling_gbps)
             : fmt::format("raw ceiling (fi_write 1 MiB): {:.2f} GB/s\n", r.ceiling_gbps);
    s += fmt::format("{:<12} {:>7} {:>10} {:>8} {:>9} {:>9} {:>7} {:>7} {:>10} {:>10} {:>10}\n",
                     "mode", "tokens", "MB/req", "descr", "p50 ms", "p99 ms", "GB/s", "x ceil",
                     "caller us", "caller p99", "caller cpu");
    for (const auto& row : r.rows) {
        s += fmt::format(
            "{:<12} {:>7} {:>10.1f} {:>8} {:>9.2f} {:>9.2f} {:>7.2f} {:>7.2f} {:>10.1f} "
            "{:>10.1f} {:>10.1f}\n",
            row.mode, row.tokens, static_cast<double>(row.bytes) / 1e6, row.descriptors, row.p50_ms,
            row.p99_ms, row.gbps, r.ceiling_gbps > 0 ? row.gbps / r.ceiling_gbps : 0.0,
            row.caller_us_p50, row.caller_us_p99, row.caller_cpu_us_p50);
    }
    return s;
}

nlohmann::json kv_report_json(const KvBenchConfig& c, const KvBenchReport& r) {
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& row : r.rows) {
        rows.push_back({{"mode", row.mode},
                        {"tokens", row.tokens},
                        {"bytes", row.bytes},
                        {"descriptors", row.descriptors},
                        {"p50_ms", row.p50_ms},
                        {"p99_ms", row.p99_ms},
                        {"gbps", row.gbps},
                        {"caller_us_p50", row.caller_us_p50},
                        {"caller_us_p99", row.caller_us_p99},
                        {"caller_cpu_us_p50", row.caller_cpu_us_p50}});
    }
    return {{"provider", r.provider},
            {"ceiling_gbps", r.ceiling_gbps},
            {"layers", c.layers},
            {"kv_heads", c.kv_heads},
            {"head_dim", c.head_dim},
            {"elem_size", c.elem_size},
            {"block_size", c.block_size},
            {"tp_prefill", c.tp_prefill},
            {"tp_decode", c.tp_decode},
            {"random_blocks", c.random_blocks},
            {"iters", c.iters},
            {"settle_us", c.settle_us},
            {"offer_wait_ms", c.offer_wait_ms},
            {"rows", rows}};
}

}  // namespace ferry::kv
