#include "bench/xfer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <new>
#include <numeric>
#include <random>
#include <thread>

#include "bench/limits.h"
#include "bench/raw_endpoint.h"
#include "bench/target_process.h"
#include "ferry/common/bytes.h"
#include "ferry/common/spin.h"
#include "ferry/fabric/engine.h"

namespace ferry {
namespace {

constexpr uint32_t kPing = 0x50494e47;
constexpr uint32_t kPong = 0x504f4e47;
// The waited ping-pong (the latency yardstick): each side's thread in wait_imm.
constexpr uint32_t kWaitPing = 0x57504e47;
constexpr uint32_t kWaitPong = 0x57504f47;
const Duration kWait = std::chrono::seconds(30);
const Duration kSetupWait = std::chrono::seconds(120);

using bench::recv_frame;
using bench::send_frame;

struct Sizes {
    size_t slot = 0;  // bytes per rotating slot
    int slots = 4;
    size_t buffer = 0;
};

Sizes buffer_sizes(const XferBenchConfig& c) {
    Sizes s;
    size_t max_size = 4096;
    for (size_t x : c.sizes) max_size = std::max(max_size, x);
    s.slot = max_size;
    if (c.region_bytes > s.slot * s.slots) {
        s.slots = static_cast<int>(c.region_bytes / s.slot);
    }
    s.buffer = s.slot * s.slots;
    // Paged writes pick pages across a region of at least 64 MiB so they do not all hit the
    // same cache lines.
    size_t paged = 0;
    for (size_t p : c.pages) paged = std::max(paged, p * 1024);
    s.buffer = std::max({s.buffer, paged, size_t{64} << 20});
    return s;
}

EngineConfig engine_config(const XferBenchConfig& c) {
    EngineConfig e;
    e.provider = c.provider;
    e.num_rails = c.rails;
    e.peers_on_same_host = true;
    // Raw and engine points alternate in one run (so both see the same load on a shared
    // host), and an engine with busy_poll would spin through the raw points beside the raw
    // loop. So the workers nap between engine points and are held awake during them with
    // expect_arrivals, which polls exactly like busy_poll.
    e.busy_poll = false;
    e.inject = c.inject;
    e.post_more = c.post_more;
    e.inject_completions = c.inject_completions;
    return e;
}

// Target commands: which side of this process polls for the next point.
constexpr uint8_t kModeRaw = 'r';      // the raw endpoint (bandwidth raw loops)
constexpr uint8_t kModeRate = 'p';     // the rate section's raw endpoints (both loops)
constexpr uint8_t kModeEngine = 'e';   // the engine (engine bandwidth and rate points)
constexpr uint8_t kModeLatency = 'l';  // the engine, answering pings too (the latency point)
// The engine left to its own polling policy, nothing held awake: the yardstick rates, as the
// Python benchmark's engines run (on a 2-core host a worker held awake takes a core).
constexpr uint8_t kModeQuiet = 'y';
// Quiet, and a thread answering each kWaitPing with a kWaitPong, waiting in wait_imm.
constexpr uint8_t kModeWaitedPong = 'w';

Duration spin_of(const XferBenchConfig& c) {
    return std::chrono::duration_cast<Duration>(
        std::chrono::duration<double, std::micro>(std::max(0.0, c.wait_spin_us)));
}
constexpr uint8_t kQuit = 'q';

size_t rate_slot_bytes(const XferBenchConfig& c) {
    size_t m = 4096;  // scatters use 4 KiB slices
    for (size_t s : c.rate_sizes) m = std::max(m, s);
    return m;
}
constexpr int kRateSlots = 4;
// The yardsticks' rate writes: 4 KiB, source and destination offsets rotating over 256 slots
// (1 MiB), as python3 -m ferry.bench_xfer writes them; each carries kYardstickImm.
constexpr size_t kYardstickBytes = 4096;
constexpr int kYardstickSlots = 256;
constexpr uint32_t kYardstickImm = 0x52415445;
// Bounds of --window and --pages-per-op (run_xfer_bench says why).
constexpr int64_t kMaxWindow = 65536;
constexpr int64_t kMaxPagesPerOp = 512;

bool wants_rows(const XferBenchConfig& c, const std::string& which) {
    return std::find(c.rate_rows.begin(), c.rate_rows.end(), which) != c.rate_rows.end();
}

int max_rate_peers(const XferBenchConfig& c) {
    if (!c.rate) return 0;
    int m = 0;
    for (int p : c.rate_peers) m = std::max(m, p);
    for (int p : c.scatter_peers) m = std::max(m, p);
    return m;
}

// Both processes' buffers, checked before the target is forked.
Status check_xfer_memory(const XferBenchConfig& c) {
    double largest = 4096, page = 0, rate = 4096;
    for (size_t x : c.sizes) largest = std::max(largest, static_cast<double>(x));
    for (size_t p : c.pages) page = std::max(page, static_cast<double>(p));
    for (size_t r : c.rate_sizes) rate = std::max(rate, static_cast<double>(r));
    const double buffer =
        std::max({largest * 4, static_cast<double>(c.region_bytes), page * 1024, double{64 << 20}});
    const double peers = c.rate ? rate * kRateSlots * std::max(max_rate_peers(c), 1) : 0;
    return bench::check_bench_memory(
        "xfer",
        fmt::format("the buffers for --sizes up to {:.0f} (4 slots of the largest), --pages up "
                    "to {:.0f} (1024 pages of the largest) in each of two processes{}",
                    largest, page,
                    c.rate ? fmt::format(" and --rate-sizes up to {:.0f} for {} peers", rate,
                                         max_rate_peers(c))
                           : ""),
        2 * buffer + peers);
}

// ---- target process -------------------------------------------------------------------

int target_main(int fd, const XferBenchConfig& c) {
    Sizes sz = buffer_sizes(c);
    std::vector<uint8_t> buf(sz.buffer, 0);
    EngineConfig ec = engine_config(c);
    ByteWriter w;
    // The raw endpoint for the bandwidth points, and one raw endpoint per rate-section peer
    // (the many-peer targets of both the raw and the engine rate loops: 64 engines would be
    // 64 worker threads on the host being measured).
    auto raw = detail::RawEndpoint::open(ec, buf.data(), buf.size());
    const int npeers = max_rate_peers(c);
    const size_t peer_bytes = rate_slot_bytes(c) * kRateSlots;
    std::vector<uint8_t> peer_buf(peer_bytes * std::max(npeers, 1), 0);
    std::vector<std::unique_ptr<detail::RawEndpoint>> peers;
    Status st = raw.ok() ? ok_status() : raw.status();
    for (int i = 0; i < npeers && st.ok(); ++i) {
        auto e = detail::RawEndpoint::open(ec, peer_buf.data() + i * peer_bytes, peer_bytes);
        if (!e.ok())
            st = e.status();
        else
            peers.push_back(std::move(*e));
    }
    auto engine =
        st.ok() ? TransferEngine::create(ec) : Result<std::unique_ptr<TransferEngine>>(st);
    std::unique_ptr<MemoryRegion> mr;
    if (engine.ok()) {
        auto r = (*engine)->register_memory(buf.data(), buf.size());
        if (r.ok())
            mr = std::move(*r);
        else
            st = r.status();
    } else {
        st = engine.status();
    }
    w.put<uint8_t>(st.ok());
    if (!st.ok()) {
        // Code and message apart: the initiator rebuilds the status with its own code, where
        // the whole string under a second code read "unavailable: bench target: unavailable:".
        w.put<uint8_t>(static_cast<uint8_t>(st.code()));
        w.put_string(st.message());
        send_frame(fd, w.bytes());
        return 1;
    }
    w.put_bytes((*raw)->name());
    w.put((*raw)->wire_base());
    w.put((*raw)->key());
    w.put<uint32_t>(static_cast<uint32_t>(peers.size()));
    for (auto& p : peers) {
        w.put_bytes(p->name());
        w.put(p->wire_base());
        w.put(p->key());
        w.put<uint8_t>(p->virt_addr());
    }
    (*engine)->address().encode(w);
    mr->descriptor().encode(w);
    if (!send_frame(fd, w.bytes())) return 1;

    std::vector<uint8_t> blob;
    if (!recv_frame(fd, &blob)) return 1;
    ByteReader rd(blob);
    auto paddr = EngineAddress::decode(rd);
    auto pdesc = MemoryDescriptor::decode(rd);
    if (!paddr.ok() || !pdesc.ok()) return 1;
    auto peer = (*engine)->connect(*paddr);
    if (!peer.ok()) return 1;
    TransferEngine* eng = engine->get();
    MemoryDescriptor parent_desc = *pdesc;
    PeerId pid = *peer;
    MemoryRegion* region = mr.get();
    const size_t pong_bytes = c.latency_size;
    std::function<void(const Status&)> pong = [&](const Status& s) {
        if (!s.ok()) return;  // shutdown
        eng->write({pid, region, 0, &parent_desc, 0, pong_bytes, kPong});
        eng->on_imm(kPing, 1, std::chrono::hours(1), pong);
    };

    // Mode loop: the raw endpoints are progressed by a poller thread in raw mode; the engine's
    // worker is held awake in engine mode. Only one of them polls at a time, and the other
    // sleeps until its mode comes back. Dev machine (2 cores, 1 MiB writes, 2026-12-03): the
    // poller used to sleep in 200 us steps through the engine passes, ~3000 wake-ups/s and
    // 7-9% of a core taken from them; and the ping-pong's waiter, registered at the start,
    // held the engine's worker awake (polling, yielding: it never slept) through every raw
    // pass (per-thread /proc schedstat of both processes).
    std::atomic<uint8_t> polling{0};  // 0, kModeRaw or kModeRate
    std::atomic<bool> quit{false};
    std::mutex mode_mu;
    std::condition_variable mode_cv;
    std::thread poller([&] {
        IdleWait idle;  // as the engine's worker, which polls for the engine points
        while (!quit.load(std::memory_order_relaxed)) {
            uint8_t m = polling.load(std::memory_order_acquire);
            if (m == 0) {
                // The deadline only bounds a missed notification; a mode change notifies.
                std::unique_lock lk(mode_mu);
                mode_cv.wait_for(lk, std::chrono::milliseconds(100),
                                 [&] { return polling.load() != 0 || quit.load(); });
                continue;
            }
            bool any = false;
            if (m == kModeRaw) {
                any = (*raw)->poll();
            } else {
                for (auto& p : peers) any |= p->poll();
            }
            if (!any) idle();
        }
    });
    ArrivalsExpected awake;
    bool pinging = false;
    std::atomic<bool> stop_waiter{false};
    std::thread waiter;  // kModeWaitedPong's answering thread
    auto waited_pong = [&] {
        while (!stop_waiter.load()) {
            // A short deadline only so the thread notices the end of the run.
            if (eng->wait_imm(kWaitPing, 1, std::chrono::milliseconds(200), spin_of(c)).ok()) {
                eng->write({pid, region, 0, &parent_desc, 0, pong_bytes, kWaitPong});
            }
        }
    };
    auto set_polling = [&](uint8_t m) {
        {
            std::lock_guard lk(mode_mu);
            polling = m;
        }
        mode_cv.notify_one();
    };
    std::vector<uint8_t> cmd;
    while (recv_frame(fd, &cmd) && !cmd.empty() && cmd[0] != kQuit) {
        if (cmd[0] == kModeRaw || cmd[0] == kModeRate) {
            awake.reset();
            set_polling(cmd[0]);
        } else if (cmd[0] == kModeQuiet || cmd[0] == kModeWaitedPong) {
            awake.reset();
            set_polling(0);
            if (cmd[0] == kModeWaitedPong && !waiter.joinable()) waiter = std::thread(waited_pong);
        } else {
            set_polling(0);
            if (!awake.active()) awake = ArrivalsExpected(eng);
            if (cmd[0] == kModeLatency && !pinging) {
                pinging = true;  // answered until the end: the latency point is the last
                eng->on_imm(kPing, 1, std::chrono::hours(1), pong);
            }
        }
        uint8_t ack = 1;
        if (!send_frame(fd, {&ack, 1})) break;
    }
    quit = true;
    stop_waiter = true;
    if (waiter.joinable()) waiter.join();
    mode_cv.notify_one();
    poller.join();
    awake.reset();
    engine->reset();
    return 0;
}

// ---- initiator ------------------------------------------------------------------------

class Initiator {
  public:
    Initiator(const XferBenchConfig& c, int fd) : c_(c), fd_(fd), sz_(buffer_sizes(c)) {
        buf_.resize(sz_.buffer);
        std::mt19937_64 rng(1);
        for (auto& b : buf_) b = static_cast<uint8_t>(rng());
    }

    Result<XferReport> run();

  private:
    // The write, paged-write and small-write points (all but the rate section).
    Status bandwidth_points(XferReport& rep);
    void note(const std::string& s) {
        if (c_.progress) c_.progress(s);
    }
    Status setup();
    Status mode(uint8_t m);
    // One point measured c_.repeat times, raw and engine alternating; keeps the best of each.
    Status point(XferRow& row, double unit_bytes,
                 const std::function<Result<double>()>& raw_ops_per_s,
                 const std::function<Result<double>()>& engine_ops_per_s, bool engine_target);
    // Keeps up to `window` operations in flight: submit(n, release) posts the n-th unit of
    // `unit` operations, each of which calls release(k) for the k it completes. Returns
    // operations completed per second.
    // The operations' callbacks capture only a pointer to release, so they fit std::function's
    // own storage: capturing release itself cost every engine operation two heap allocations
    // in the bench (measured against a raw loop that has none).
    using Release = std::function<void(int, const Status&)>;
    Result<double> windowed(int window, int unit,
                            const std::function<void(uint64_t, const Release*)>& submit);
    Result<double> engine_write_loop(size_t size, int window);
    Result<double> engine_paged_loop(size_t page);
    Result<double> engine_rate_loop(int npeers, size_t size, int window, bool one_op);
    Result<double> engine_scatter_loop(int npeers, size_t size, int window);
    // Writes of kYardstickBytes with an immediate to the peer's engine, `per_call` per call:
    // write() for 1, write_runs otherwise.
    Result<double> engine_imm_loop(int window, int per_call);
    // The yardsticks' rate figures (rep.yardsticks), engine and raw alternating.
    Status yardstick_rates(XferReport& rep);
    Status latency(XferReport& rep);
    // The ping-pong with this thread writing and waiting in wait_imm, as Python's benchmark.
    Status waited_latency(XferReport& rep);

    XferBenchConfig c_;
    int fd_;
    Sizes sz_;
    std::vector<uint8_t> buf_;
    std::unique_ptr<detail::RawEndpoint> raw_;
    fi_addr_t raw_dest_ = FI_ADDR_UNSPEC;
    uint64_t raw_base_ = 0, raw_key_ = 0;
    std::vector<detail::RawEndpoint::Target> rate_targets_;
    std::unique_ptr<TransferEngine> engine_;
    std::unique_ptr<MemoryRegion> mr_;
    PeerId peer_ = 0;
    MemoryDescriptor remote_;
    std::vector<PeerId> rate_peers_;  // the target's raw endpoints as engine peers
    std::vector<MemoryDescriptor> rate_dsts_;
    std::vector<std::pair<int, GroupId>> groups_;  // scatter groups by size
};

Duration point_duration(const XferBenchConfig& c) {
    return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(c.seconds_per_point));
}

// Every set-up frame from the target starts with an ok byte, followed by its error on failure.
Status read_target_status(ByteReader& rd) {
    uint8_t ok = 0;
    FERRY_RETURN_IF_ERROR(rd.get(&ok, "ok"));
    if (ok) return ok_status();
    uint8_t code = 0;
    std::string why;
    FERRY_RETURN_IF_ERROR(rd.get(&code, "code"));
    (void)rd.get_string(&why, "error", 4096);
    if (code == 0 || code > static_cast<uint8_t>(StatusCode::kAlreadyExists))
        code = static_cast<uint8_t>(StatusCode::kUnavailable);
    return Status(static_cast<StatusCode>(code), "bench target: " + why);
}

Status Initiator::mode(uint8_t m) {
    uint8_t b = m;
    std::vector<uint8_t> ack;
    if (!send_frame(fd_, {&b, 1}) || !recv_frame(fd_, &ack, kWait)) {
        return unavailable("bench target is gone");
    }
    return ok_status();
}

Status Initiator::setup() {
    std::vector<uint8_t> blob;
    // The target allocates and fills its buffers and opens its endpoints first.
    if (!recv_frame(fd_, &blob, kSetupWait))
        return unavailable("bench target died or did not answer during set-up");
    ByteReader rd(blob);
    FERRY_RETURN_IF_ERROR(read_target_status(rd));
    std::vector<uint8_t> name;
    FERRY_RETURN_IF_ERROR(rd.get_bytes(&name, "name", 1024));
    FERRY_RETURN_IF_ERROR(rd.get(&raw_base_, "base"));
    FERRY_RETURN_IF_ERROR(rd.get(&raw_key_, "key"));
    uint32_t npeers = 0;
    FERRY_RETURN_IF_ERROR(rd.get(&npeers, "peers"));
    struct RawPeer {
        std::vector<uint8_t> name;
        uint64_t base = 0, key = 0;
        uint8_t virt = 1;
    };
    std::vector<RawPeer> rp(npeers);
    for (auto& p : rp) {
        FERRY_RETURN_IF_ERROR(rd.get_bytes(&p.name, "peer name", 1024));
        FERRY_RETURN_IF_ERROR(rd.get(&p.base, "peer base"));
        FERRY_RETURN_IF_ERROR(rd.get(&p.key, "peer key"));
        FERRY_RETURN_IF_ERROR(rd.get(&p.virt, "peer virt"));
    }
    FERRY_ASSIGN_OR_RETURN(auto taddr, EngineAddress::decode(rd));
    FERRY_ASSIGN_OR_RETURN(remote_, MemoryDescriptor::decode(rd));

    FERRY_ASSIGN_OR_RETURN(raw_,
                           detail::RawEndpoint::open(engine_config(c_), buf_.data(), buf_.size()));
    FERRY_ASSIGN_OR_RETURN(raw_dest_, raw_->insert(name));
    for (auto& p : rp) {
        FERRY_ASSIGN_OR_RETURN(fi_addr_t d, raw_->insert(p.name));
        rate_targets_.push_back({d, p.base, p.key});
    }
    FERRY_ASSIGN_OR_RETURN(engine_, TransferEngine::create(engine_config(c_)));
    FERRY_ASSIGN_OR_RETURN(mr_, engine_->register_memory(buf_.data(), buf_.size()));
    FERRY_ASSIGN_OR_RETURN(peer_, engine_->connect(taddr));
    // The target's raw endpoints as engine peers: an address with one rail and a descriptor
    // naming the raw registration (the signal region too, for immediate-only writes).
    const size_t peer_bytes = rate_slot_bytes(c_) * kRateSlots;
    std::mt19937_64 ids(std::random_device{}());
    for (auto& p : rp) {
        EngineAddress a;
        a.engine_id = ids();
        a.provider = taddr.provider;
        a.host_id = taddr.host_id;
        a.rail_addrs = {p.name};
        MemoryDescriptor d;
        d.engine_id = a.engine_id;
        d.base = p.base;
        d.length = peer_bytes;
        d.virt_addr = p.virt != 0;
        d.rail_keys = {p.key};
        a.signal = d;
        FERRY_ASSIGN_OR_RETURN(PeerId id, engine_->connect(a));
        rate_peers_.push_back(id);
        rate_dsts_.push_back(d);
    }
    if (c_.rate) {
        for (int n : c_.scatter_peers) {
            if (n > static_cast<int>(rate_peers_.size())) continue;
            FERRY_ASSIGN_OR_RETURN(GroupId g,
                                   engine_->create_group(std::span(rate_peers_).first(n),
                                                         std::span(rate_dsts_).first(n)));
            groups_.emplace_back(n, g);
        }
    }
    ByteWriter w;
    engine_->address().encode(w);
    mr_->descriptor().encode(w);
    if (!send_frame(fd_, w.bytes())) return unavailable("bench target is gone");
    return ok_status();
}

// CPU seconds used so far by the whole process (RUSAGE_SELF) or the calling thread.
double cpu_seconds(int who) {
    rusage ru{};
    getrusage(who, &ru);
    auto sec = [](const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; };
    return sec(ru.ru_utime) + sec(ru.ru_stime);
}

// Runs one measurement and says what it cost in CPU: microseconds per operation of the
// whole process and of the calling thread (for the engine: the submitter; the rest is the
// rail worker).
struct Costed {
    double ops_per_s = 0;
    double cpu_us_per_op = 0;
    double caller_us_per_op = 0;
};
Result<Costed> costed(const std::function<Result<double>()>& fn) {
    double p0 = cpu_seconds(RUSAGE_SELF), t0 = cpu_seconds(RUSAGE_THREAD);
    auto w0 = Clock::now();
    FERRY_ASSIGN_OR_RETURN(double rate, fn());
    double wall = std::chrono::duration<double>(Clock::now() - w0).count();
    double ops = rate * wall;
    Costed c;
    c.ops_per_s = rate;
    if (ops > 0) {
        c.cpu_us_per_op = (cpu_seconds(RUSAGE_SELF) - p0) * 1e6 / ops;
        c.caller_us_per_op = (cpu_seconds(RUSAGE_THREAD) - t0) * 1e6 / ops;
    }
    return c;
}

Status Initiator::point(XferRow& row, double unit_bytes,
                        const std::function<Result<double>()>& raw_ops_per_s,
                        const std::function<Result<double>()>& engine_ops_per_s,
                        bool engine_target) {
    std::string pairs;
    double raw_cpu = 0, eng_cpu = 0, eng_caller = 0;
    const uint64_t raw_before = raw_->completed(), eng_before = engine_->stats().ops_posted;
    if (row.peers > 0) {
        // Unrecorded first pair: tcp;ofi_rxm connects to each peer on first use, which made the
        // first raw pass to 64 peers run at ~130 writes/s.
        FERRY_RETURN_IF_ERROR(mode(kModeRate));
        FERRY_RETURN_IF_ERROR(raw_ops_per_s().status());
        ArrivalsExpected awake(engine_.get());
        FERRY_RETURN_IF_ERROR(engine_ops_per_s().status());
    }
    for (int rep = 0; rep < c_.repeat; ++rep) {
        FERRY_RETURN_IF_ERROR(mode(engine_target ? kModeRaw : kModeRate));
        FERRY_ASSIGN_OR_RETURN(Costed raw, costed(raw_ops_per_s));
        FERRY_RETURN_IF_ERROR(mode(engine_target ? kModeEngine : kModeRate));
        Costed eng;
        {
            ArrivalsExpected awake(engine_.get());
            FERRY_ASSIGN_OR_RETURN(eng, costed(engine_ops_per_s));
        }
        if (raw.ops_per_s > row.raw_ops) {
            row.raw_ops = raw.ops_per_s;
            raw_cpu = raw.cpu_us_per_op;
        }
        if (eng.ops_per_s > row.engine_ops) {
            row.engine_ops = eng.ops_per_s;
            eng_cpu = eng.cpu_us_per_op;
            eng_caller = eng.caller_us_per_op;
        }
        double r = raw.ops_per_s > 0 ? eng.ops_per_s / raw.ops_per_s : 0;
        row.samples.push_back(r);
        pairs += fmt::format(" {:.2f}", r);
    }
    row.raw_gbps = row.raw_ops * unit_bytes / 1e9;
    row.engine_gbps = row.engine_ops * unit_bytes / 1e9;
    row.raw_cpu_us = raw_cpu;
    row.engine_cpu_us = eng_cpu;
    row.engine_caller_cpu_us = eng_caller;
    // Every write of the point, warm-up pass included: what an instruction count of the whole
    // point (callgrind) is divided by.
    note(fmt::format(
        "{:<12} {:>8} B{}: raw {:.0f} ops/s, engine {:.0f} ops/s, best-of-{} "
        "ratio {:.2f}x (each pair:{}); CPU us/op raw {:.2f}, engine {:.2f} "
        "(submitter {:.2f}, worker {:.2f}); writes in all passes: raw {}, engine {}",
        row.kind, row.size, row.peers ? fmt::format(" x{} peers", row.peers) : std::string(),
        row.raw_ops, row.engine_ops, c_.repeat, row.ratio(), pairs, raw_cpu, eng_cpu, eng_caller,
        eng_cpu - eng_caller, raw_->completed() - raw_before,
        engine_->stats().ops_posted - eng_before));
    return ok_status();
}

Result<double> Initiator::windowed(int window, int unit,
                                   const std::function<void(uint64_t, const Release*)>& submit) {
    std::atomic<int> inflight{0};
    std::atomic<uint64_t> done{0};
    std::atomic<bool> failed{false};
    Status first_error;
    std::mutex err_mu;
    // With cores to spare the submitter polls for room in the window, as the raw loop does;
    // sleeping until the window drained to half (one futex wake-up per half window) kept the
    // engine's 64 B rate at ~0.73 M writes/s on the 16-core host whatever the engine did.
    // Where cores are scarce it sleeps, leaving the core to the rail's worker.
    IdleWait idle;
    const int low = std::max(0, std::min(window / 2, window - unit));
    const Release release = [&](int k, const Status& s) {
        if (!s.ok()) {
            std::lock_guard lk(err_mu);
            if (first_error.ok()) first_error = s;
            failed = true;
        }
        done.fetch_add(k, std::memory_order_relaxed);
        int before = inflight.fetch_sub(k, std::memory_order_acq_rel);
        if (before > low && before - k <= low) inflight.notify_one();
    };
    auto start = Clock::now();
    auto stop = start + point_duration(c_);
    uint64_t posted = 0;
    while (!failed) {
        int cur = inflight.load(std::memory_order_acquire);
        if (cur + unit > window) {
            if (idle.spins()) {
                idle();
                continue;
            }
            while (cur > low) {
                inflight.wait(cur, std::memory_order_acquire);
                cur = inflight.load(std::memory_order_acquire);
            }
            continue;
        }
        if (Clock::now() >= stop) break;
        inflight.fetch_add(unit, std::memory_order_relaxed);
        submit(posted++, &release);
    }
    auto deadline = deadline_after(kWait);
    while (inflight.load() > 0 && Clock::now() < deadline) std::this_thread::yield();
    if (inflight.load() > 0) return timeout_error("bench: operations still in flight after 30 s");
    if (failed) return first_error;
    double secs = std::chrono::duration<double>(Clock::now() - start).count();
    return static_cast<double>(done.load()) / secs;
}

Result<double> Initiator::engine_write_loop(size_t size, int window) {
    return windowed(window, 1, [&](uint64_t n, const Release* release) {
        size_t slot = n % sz_.slots;
        engine_->write({peer_, mr_.get(), slot * size, &remote_, slot * size, size, std::nullopt},
                       [release](const Status& s) { (*release)(1, s); });
    });
}

Result<double> Initiator::engine_paged_loop(size_t page) {
    // Random, non-adjacent page lists (every other page), as a paged KV cache's blocks are:
    // nothing coalesces, so this measures the per-page cost.
    uint32_t npages = static_cast<uint32_t>(sz_.buffer / page / 2);
    if (size_t(c_.pages_per_op) > npages)  // run_xfer_bench's bound keeps this from happening
        return invalid_argument(
            fmt::format("bench xfer: --pages-per-op {} is more than the {} "
                        "pages of {} B the buffer offers",
                        c_.pages_per_op, npages, page));
    std::mt19937 rng(7);
    std::vector<std::vector<uint32_t>> lists(16);
    for (auto& l : lists) {
        std::vector<uint32_t> perm(npages);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int i = 0; i < c_.pages_per_op; ++i) l.push_back(perm[i] * 2);
    }
    const int per = c_.pages_per_op;
    int window = std::max(1, c_.window / per) * 2 * per;
    return windowed(window, per, [&](uint64_t n, const Release* release) {
        PagedWriteOp p;
        p.peer = peer_;
        p.src = mr_.get();
        p.dst = &remote_;
        p.page_size = page;
        p.src_pages = lists[n % lists.size()];
        p.dst_pages = lists[(n + 5) % lists.size()];
        engine_->paged_write(p, [release, per](const Status& s) { (*release)(per, s); });
    });
}

// Writes with immediates round robin over npeers, handed over rate_batch at a time: with
// submit_batch (a handle and a completion per write), or with one_op, submit_all (one
// completion per batch). The engine's answer to a raw loop that posts one at a time.
Result<double> Initiator::engine_rate_loop(int npeers, size_t size, int window, bool one_op) {
    const int batch = std::max(1, std::min(c_.rate_batch, window));
    std::vector<BatchEntry> entries(batch);
    uint64_t seq = 0;
    return windowed(window, batch, [&](uint64_t, const Release* release) {
        for (int i = 0; i < batch; ++i, ++seq) {
            int p = static_cast<int>(seq % npeers);
            uint64_t slot = (seq / npeers) % kRateSlots;
            entries[i] =
                WriteOp{rate_peers_[p], mr_.get(), (seq % 4) * size,          &rate_dsts_[p],
                        slot * size,    size,      static_cast<uint32_t>(seq)};
        }
        if (one_op) {
            engine_->submit_all(entries,
                                [release, batch](const Status& s) { (*release)(batch, s); });
        } else {
            engine_->submit_batch(entries,
                                  [release](size_t, const Status& s) { (*release)(1, s); });
        }
    });
}

Result<double> Initiator::engine_scatter_loop(int npeers, size_t size, int window) {
    GroupId g = 0;
    bool found = false;
    for (auto& [n, id] : groups_) {
        if (n == npeers) g = id, found = true;
    }
    if (!found) return invalid_argument(fmt::format("bench: no scatter group of {}", npeers));
    std::vector<ScatterSlice> slices(npeers);
    return windowed(std::max(window, npeers), npeers, [&](uint64_t n, const Release* release) {
        for (int i = 0; i < npeers; ++i) {
            slices[i] = {static_cast<uint32_t>(i), (i % 4) * size, (n % kRateSlots) * size, size};
        }
        engine_->scatter({g, mr_.get(), slices, static_cast<uint32_t>(n)},
                         [release, npeers](const Status& s) { (*release)(npeers, s); });
    });
}

Result<double> Initiator::engine_imm_loop(int window, int per_call) {
    std::vector<WriteRun> runs(per_call);
    return windowed(window, per_call, [&](uint64_t n, const Release* release) {
        const uint64_t first = n * static_cast<uint64_t>(per_call);
        for (int i = 0; i < per_call; ++i) {
            const uint64_t off = ((first + i) % kYardstickSlots) * kYardstickBytes;
            runs[i] = {off, off, kYardstickBytes};
        }
        if (per_call == 1) {
            engine_->write({peer_, mr_.get(), runs[0].src_offset, &remote_, runs[0].dst_offset,
                            kYardstickBytes, kYardstickImm},
                           [release](const Status& s) { (*release)(1, s); });
        } else {
            engine_->write_runs({peer_, mr_.get(), &remote_, runs, kYardstickImm},
                                [release, per_call](const Status& s) { (*release)(per_call, s); });
        }
    });
}

Status Initiator::yardstick_rates(XferReport& rep) {
    const int batch = std::max(1, std::min(c_.rate_batch, c_.window));
    const detail::RawEndpoint::Target target{raw_dest_, raw_base_, raw_key_};
    double raw = 0, single = 0, runs = 0;
    for (int i = 0; i < c_.repeat; ++i) {
        FERRY_RETURN_IF_ERROR(mode(kModeRaw));
        FERRY_ASSIGN_OR_RETURN(double r,
                               raw_->rate_loop({&target, 1}, kYardstickBytes, true, c_.window,
                                               kYardstickSlots, point_duration(c_)));
        // Neither engine held awake: the Python benchmark's engines are not either.
        FERRY_RETURN_IF_ERROR(mode(kModeQuiet));
        FERRY_ASSIGN_OR_RETURN(double one, engine_imm_loop(c_.window, 1));
        FERRY_ASSIGN_OR_RETURN(double many, engine_imm_loop(c_.window, batch));
        raw = std::max(raw, r);
        single = std::max(single, one);
        runs = std::max(runs, many);
    }
    rep.yardsticks.push_back(
        {"rate_4KiB_write",
         fmt::format("write+imm 4 KiB, one write() per write, {} in flight", c_.window), "op/s",
         single, 0, raw});
    rep.yardsticks.push_back({fmt::format("rate_4KiB_runs{}", batch),
                              fmt::format("write+imm 4 KiB, write_runs of {}, {} writes in flight",
                                          batch, std::max(c_.window / batch, 1) * batch),
                              "op/s", runs, 0, raw});
    note(
        fmt::format("yardsticks: 4 KiB write+imm {:.0f} op/s one per call, {:.0f} op/s in "
                    "write_runs of {}; raw fi_writedata {:.0f} op/s",
                    single, runs, batch, raw));
    return ok_status();
}

Status Initiator::waited_latency(XferReport& rep) {
    const int warmup = std::min(200, c_.latency_iters / 10);
    std::vector<double> us;
    us.reserve(c_.latency_iters);
    const WriteOp ping{peer_, mr_.get(), 0, &remote_, 0, c_.latency_size, kWaitPing};
    for (int i = 0; i < warmup + c_.latency_iters; ++i) {
        const TimePoint t0 = Clock::now();
        engine_->write(ping);
        Status s = engine_->wait_imm(kWaitPong, 1, std::chrono::seconds(5), spin_of(c_));
        if (!s.ok()) return s.with_context("waited latency ping-pong");
        if (i >= warmup) us.push_back(to_us(Clock::now() - t0) / 2);
    }
    if (us.empty()) return internal_error("waited latency: no round trip was timed");
    std::sort(us.begin(), us.end());
    rep.waited_latency_p50_us = us[us.size() / 2];
    rep.waited_latency_p99_us = us[std::min(us.size() - 1, us.size() * 99 / 100)];
    return ok_status();
}

Status Initiator::latency(XferReport& rep) {
    // The whole ping-pong runs in completion callbacks on the worker thread, so no other
    // thread competes for a core while it is timed. The state is shared with the callbacks:
    // one may still run after a timeout below returned.
    struct State {
        std::mutex mu;
        std::condition_variable cv;
        int left = 0;
        int warmup = 0;
        TimePoint t0;
        std::vector<double> us;
        bool done = false;
        Status error;
        std::function<void(const Status&)> on_pong;
    };
    auto st = std::make_shared<State>();
    st->warmup = std::min(200, c_.latency_iters / 10);
    st->left = c_.latency_iters + st->warmup;
    st->us.reserve(st->left);
    TransferEngine* engine = engine_.get();
    const WriteOp ping{peer_, mr_.get(), 0, &remote_, 0, c_.latency_size, kPing};
    std::weak_ptr<State> weak = st;
    // t0 is only touched by the chain itself (each pong follows its ping); the rest under mu,
    // which no engine call is made under.
    st->on_pong = [weak, engine, ping](const Status& s) {
        auto st = weak.lock();
        if (!st) return;
        auto now = Clock::now();
        std::function<void(const Status&)> next;
        {
            std::lock_guard lk(st->mu);
            if (st->done) return;
            if (!s.ok()) st->error = s;
            if (!s.ok() || st->left <= 0) {
                st->done = true;
                st->cv.notify_all();
                return;
            }
            if (st->warmup > 0)
                --st->warmup;
            else
                st->us.push_back(to_us(now - st->t0) / 2);
            if (--st->left == 0) {
                st->done = true;
                st->cv.notify_all();
                return;
            }
            next = st->on_pong;
        }
        engine->on_imm(kPong, 1, std::chrono::seconds(5), std::move(next));
        st->t0 = Clock::now();
        engine->write(ping);
    };
    engine->on_imm(kPong, 1, std::chrono::seconds(5), st->on_pong);
    st->t0 = Clock::now();
    engine->write(ping);
    std::unique_lock lk(st->mu);
    const bool finished = st->cv.wait_for(lk, std::chrono::seconds(60), [&] { return st->done; });
    st->done = true;        // a pong still on its way ends the chain
    st->on_pong = nullptr;  // and no callback keeps the state alive through itself
    if (!finished) return timeout_error("latency: ping-pong did not finish within 60 s");
    if (!st->error.ok()) return st->error.with_context("latency ping-pong");
    if (st->us.empty()) return internal_error("latency: no round trip was timed");
    std::sort(st->us.begin(), st->us.end());
    rep.latency_p50_us = st->us[st->us.size() / 2];
    rep.latency_p99_us = st->us[std::min(st->us.size() - 1, st->us.size() * 99 / 100)];
    rep.latency_iters = c_.latency_iters;
    rep.latency_size = c_.latency_size;
    return ok_status();
}

Status Initiator::bandwidth_points(XferReport& rep) {
    Duration d = point_duration(c_);
    for (size_t size : c_.sizes) {
        XferRow row{"write", size};
        FERRY_RETURN_IF_ERROR(point(
            row, static_cast<double>(size),
            [&]() -> Result<double> {
                FERRY_ASSIGN_OR_RETURN(double bps, raw_->write_loop(raw_dest_, raw_base_, raw_key_,
                                                                    size, c_.window, sz_.slots, d));
                return bps / size;
            },
            [&] { return engine_write_loop(size, c_.window); }, true));
        rep.rows.push_back(row);
    }
    for (size_t page : c_.pages) {
        // The ceiling for paged writes is the plain loop at the page size, with destinations
        // spread over the same region the paged writes scatter into.
        int slots = static_cast<int>(std::min<size_t>(sz_.buffer / page, 1024));
        XferRow row{"paged write", page};
        FERRY_RETURN_IF_ERROR(point(
            row, static_cast<double>(page),
            [&]() -> Result<double> {
                FERRY_ASSIGN_OR_RETURN(double bps, raw_->write_loop(raw_dest_, raw_base_, raw_key_,
                                                                    page, c_.window, slots, d));
                return bps / page;
            },
            [&] { return engine_paged_loop(page); }, true));
        rep.rows.push_back(row);
    }
    {
        XferRow row{"small write", 64};
        FERRY_RETURN_IF_ERROR(point(
            row, 64.0,
            [&]() -> Result<double> {
                FERRY_ASSIGN_OR_RETURN(
                    double bps, raw_->write_loop(raw_dest_, raw_base_, raw_key_, 64, 256, 64, d));
                return bps / 64;
            },
            [&] { return engine_write_loop(64, 256); }, true));
        rep.rows.push_back(row);
    }
    return ok_status();
}

Result<XferReport> Initiator::run() {
    XferReport rep;
    rep.repeat = c_.repeat;
    FERRY_ASSIGN_OR_RETURN(rep.provider, resolve_provider(engine_config(c_)));
    FERRY_RETURN_IF_ERROR(setup());
    Duration d = point_duration(c_);
    if (!c_.rate_only && !c_.yardsticks_only) FERRY_RETURN_IF_ERROR(bandwidth_points(rep));
    if (c_.rate && !c_.yardsticks_only) {
        // Message rate: writes with immediates to 1..64 peers and scatters, each beside the raw
        // loop posting the same writes one at a time. Both loops target the same raw
        // endpoints of the target process, so the target's work is identical.
        const int window = 256;
        // "write+imm": submit_batch, a completion per write; "batch+imm": submit_all, one
        // completion per rate_batch writes.
        for (bool one_op : {false, true}) {
            if (!wants_rows(c_, one_op ? "all" : "batch")) continue;
            for (size_t size : c_.rate_sizes) {
                for (int n : c_.rate_peers) {
                    if (n > static_cast<int>(rate_targets_.size())) continue;
                    XferRow row{one_op ? "batch+imm" : "write+imm", size, n};
                    FERRY_RETURN_IF_ERROR(point(
                        row, static_cast<double>(size),
                        [&] {
                            return raw_->rate_loop(std::span(rate_targets_).first(n), size, true,
                                                   window, kRateSlots, d);
                        },
                        [&] { return engine_rate_loop(n, size, window, one_op); }, false));
                    rep.rows.push_back(row);
                }
            }
        }
        const size_t slice = 4096;
        for (int n : c_.scatter_peers) {
            if (n > static_cast<int>(rate_targets_.size()) || !wants_rows(c_, "scatter")) continue;
            XferRow row{"scatter", slice, n};
            FERRY_RETURN_IF_ERROR(point(
                row, static_cast<double>(slice),
                [&] {
                    return raw_->rate_loop(std::span(rate_targets_).first(n), slice, true,
                                           std::max(window, n), kRateSlots, d);
                },
                [&] { return engine_scatter_loop(n, slice, window); }, false));
            rep.rows.push_back(row);
        }
    }
    // --latency-iters 0: no latency point (a ping-pong of zero round trips never ended and
    // its callbacks outlived the call: a crash, 2026-12-03).
    if (!c_.rate_only && (c_.yardsticks || c_.yardsticks_only)) {
        FERRY_RETURN_IF_ERROR(yardstick_rates(rep));
    }
    if (!c_.rate_only && c_.latency_iters > 0) {
        const size_t n = c_.latency_size;
        FERRY_RETURN_IF_ERROR(mode(kModeRaw));
        FERRY_ASSIGN_OR_RETURN(double lbps,
                               raw_->write_loop(raw_dest_, raw_base_, raw_key_, n, 1, 1, d / 2));
        rep.raw_latency_p50_us = lbps > 0 ? 1e6 * static_cast<double>(n) / lbps / 2 : 0;
        FERRY_RETURN_IF_ERROR(mode(kModeLatency));
        {
            ArrivalsExpected awake(engine_.get());
            FERRY_RETURN_IF_ERROR(latency(rep));
        }
        note(fmt::format("engine write+imm latency: p50 {:.1f} us, p99 {:.1f} us",
                         rep.latency_p50_us, rep.latency_p99_us));
        if (c_.yardsticks || c_.yardsticks_only) {
            FERRY_RETURN_IF_ERROR(mode(kModeWaitedPong));
            FERRY_RETURN_IF_ERROR(waited_latency(rep));
            rep.yardsticks.insert(
                rep.yardsticks.begin(),
                {fmt::format("latency_{}B", n),
                 fmt::format("write+imm {} B one way, each side in wait_imm (spin {:g} us), p50", n,
                             std::max(0.0, c_.wait_spin_us)),
                 "us", rep.waited_latency_p50_us, rep.waited_latency_p99_us,
                 rep.raw_latency_p50_us});
        }
    }
    EngineStats es = engine_->stats();
    rep.ops_posted = es.ops_posted;
    rep.post_rounds = es.post_rounds;
    rep.ops_injected = es.ops_injected;
    rep.posted_with_more = es.posted_with_more;
    for (const EngineStats& r : engine_->rail_stats()) rep.bytes_per_rail.push_back(r.bytes_posted);
    return rep;
}

}  // namespace

Result<XferReport> run_xfer_bench(const XferBenchConfig& config) {
    if (config.sizes.empty() && !config.rate_only && !config.yardsticks_only) {
        return invalid_argument("bench xfer: no sizes given");
    }
    if (config.rate_only && !config.rate) {
        return invalid_argument("bench xfer: rate_only needs the rate section (rate)");
    }
    if (config.rate_only && config.yardsticks_only) {
        return invalid_argument("bench xfer: --rate-only and --yardsticks-only exclude each other");
    }
    if (!(config.wait_spin_us >= 0 && config.wait_spin_us <= 1e6)) {
        return invalid_argument(fmt::format("bench xfer: --wait-spin-us must be 0..1000000, got {}",
                                            config.wait_spin_us));
    }
    if (config.latency_size < 1 || config.latency_size > 65536) {
        return invalid_argument(fmt::format(
            "bench xfer: --latency-size must be 1..65536 bytes, got {}", config.latency_size));
    }
    for (size_t n : config.sizes) {
        // Found only by the engine, as "write of 0 bytes", after the target process started.
        if (n == 0) return invalid_argument("bench xfer: --sizes: every size must be at least 1");
    }
    for (size_t n : config.pages) {
        if (n == 0) return invalid_argument("bench xfer: --pages: every size must be at least 1");
    }
    if (config.rails < 1 || config.rails > 32) {
        return invalid_argument(
            fmt::format("bench xfer: --rails must be 1..32, got {}", config.rails));
    }
    if (!(config.seconds_per_point > 0)) {
        return invalid_argument("bench xfer: --seconds must be above 0");
    }
    // Per point, and a run has dozens of points, each measured --repeat times both ways.
    if (config.seconds_per_point > 3600) {
        return invalid_argument(
            fmt::format("bench xfer: --seconds is per measurement, at most 3600, got {}",
                        config.seconds_per_point));
    }
    if (config.window < 1 || config.pages_per_op < 1) {
        return invalid_argument("bench xfer: --window and --pages-per-op must be positive");
    }
    // 10^8 writes in flight ran for minutes before the first point; 65536 takes seconds.
    FERRY_RETURN_IF_ERROR(
        bench::check_bench_range("xfer", "--window", config.window, 1, kMaxWindow));
    // A paged write takes every other page of a buffer of at least 1024 pages of the largest
    // --pages size: more pages per write indexed past the page list (SIGSEGV at 10^8).
    FERRY_RETURN_IF_ERROR(
        bench::check_bench_range("xfer", "--pages-per-op", config.pages_per_op, 1, kMaxPagesPerOp));
    FERRY_RETURN_IF_ERROR(
        bench::check_bench_range("xfer", "--repeat", config.repeat, 1, bench::kMaxIters));
    FERRY_RETURN_IF_ERROR(bench::check_bench_range("xfer", "--latency-iters", config.latency_iters,
                                                   0, bench::kMaxIters));
    if (config.rate && (config.rate_sizes.empty() || config.rate_batch < 1)) {
        return invalid_argument("bench xfer: --rate needs rate sizes and a positive batch");
    }
    for (int p : config.rate_peers) {
        if (p < 1 || p > 1024) return invalid_argument("bench xfer: rate peers must be 1..1024");
    }
    for (const std::string& r : config.rate_rows) {
        if (r != "batch" && r != "all" && r != "scatter") {
            return invalid_argument(fmt::format(
                "bench xfer: rate rows are batch, all and scatter; '{}' is none of them", r));
        }
    }
    for (int p : config.scatter_peers) {
        if (p < 1 || p > 1024) {
            return invalid_argument("bench xfer: scatter peers must be 1..1024");
        }
    }
    FERRY_RETURN_IF_ERROR(check_xfer_memory(config));
    FERRY_ASSIGN_OR_RETURN(auto target, bench::TargetProcess::start(
                                            [&config](int fd) { return target_main(fd, config); }));
    Result<XferReport> rep = [&]() -> Result<XferReport> {
        try {
            Initiator init(config, target.fd());
            return init.run();
        } catch (const std::bad_alloc&) {
            return resource_exhausted(
                "bench xfer: out of memory for the buffers; use smaller --sizes or --pages");
        }
    }();
    send_frame(target.fd(), {});  // tells the target to finish
    const int status = target.finish(kWait);
    if (rep.ok() && status != 0) return internal_error("bench target exited abnormally");
    return rep;
}

namespace {
std::string human_size(size_t b) {
    if (b >= (1u << 20) && b % (1u << 20) == 0) return fmt::format("{} MiB", b >> 20);
    if (b >= 1024 && b % 1024 == 0) return fmt::format("{} KiB", b >> 10);
    return fmt::format("{} B", b);
}
}  // namespace

double XferRow::median_ratio() const { return quantile_ratio(0.5); }

double XferRow::quantile_ratio(double q) const {
    if (samples.empty()) return ratio();
    std::vector<double> s = samples;
    std::sort(s.begin(), s.end());
    const double pos = std::clamp(q, 0.0, 1.0) * static_cast<double>(s.size() - 1);
    const size_t lo = static_cast<size_t>(pos);
    const size_t hi = std::min(lo + 1, s.size() - 1);
    return s[lo] + (s[hi] - s[lo]) * (pos - static_cast<double>(lo));
}

std::string format_xfer_table(const XferReport& r) {
    // With three pairs or more, the median of the pairs' ratios beside the best-of ratio, and
    // their quartiles: on the 2-core dev machine single pairs swing 0.3x-2.5x while other
    // processes come and go, and a median without its spread read as a result.
    const bool median = r.repeat >= 3;
    std::string out = fmt::format(
        "ferry bench xfer — provider {} (two processes, one host; raw "
        "and engine alternate, best of {} each{})\n\n",
        r.provider, r.repeat, median ? "; median and quartiles: of the pairs' ratios" : "");
    out += fmt::format("{:<12} {:>9} {:>6} {:>10} {:>12} {:>7}{} {:>13} {:>13}\n", "operation",
                       "size", "peers", "raw GB/s", "engine GB/s", "ratio",
                       median ? fmt::format(" {:>7} {:>11}", "median", "quartiles") : std::string(),
                       "raw ops/s", "engine ops/s");
    for (const auto& row : r.rows) {
        const std::string spread =
            median ? fmt::format(" {:>6.2f}x {:>5.2f}-{:.2f}x", row.median_ratio(),
                                 row.quantile_ratio(0.25), row.quantile_ratio(0.75))
                   : std::string();
        out +=
            fmt::format("{:<12} {:>9} {:>6} {:>10.2f} {:>12.2f} {:>6.2f}x{} {:>13.0f} {:>13.0f}\n",
                        row.kind, human_size(row.size), row.peers ? row.peers : 1, row.raw_gbps,
                        row.engine_gbps, row.ratio(), spread, row.raw_ops, row.engine_ops);
    }
    out += "\n";
    if (r.latency_iters > 0) {
        out += fmt::format(
            "write with immediate, {} B, one-way (half round trip, {} iterations, in the "
            "workers' callbacks): p50 {:.1f} us, p99 {:.1f} us (raw fi_write, window 1: "
            "{:.1f} us)\n",
            r.latency_size, r.latency_iters, r.latency_p50_us, r.latency_p99_us,
            r.raw_latency_p50_us);
    }
    if (!r.yardsticks.empty()) {
        out += fmt::format(
            "yardsticks (to the peer's engine; `python3 -m ferry.bench_xfer` times the same "
            "operations from Python and divides by these):\n");
        for (const XferYardstick& y : r.yardsticks) {
            const std::string p99 =
                y.unit == "us" ? fmt::format(" (p99 {:.1f})", y.p99) : std::string();
            out += fmt::format("  {:<18} {:<70} {:>10.1f} {}{}  raw fi_writedata {:.1f}\n", y.name,
                               y.what, y.value, y.unit, p99, y.raw);
        }
    }
    if (r.post_rounds) {
        out += fmt::format(
            "engine posts: {} ops in {} worker passes ({:.1f} per pass), {} with "
            "FI_INJECT, {} with FI_MORE\n",
            r.ops_posted, r.post_rounds, static_cast<double>(r.ops_posted) / r.post_rounds,
            r.ops_injected, r.posted_with_more);
    }
    if (r.bytes_per_rail.size() > 1) {
        out += fmt::format("engine bytes per rail: {}\n", fmt::join(r.bytes_per_rail, ", "));
    }
    return out;
}

nlohmann::json xfer_report_json(const XferReport& r) {
    nlohmann::json j;
    j["benchmark"] = "xfer";
    j["provider"] = r.provider;
    j["rows"] = nlohmann::json::array();
    for (const auto& row : r.rows) {
        j["rows"].push_back({{"kind", row.kind},
                             {"size_bytes", row.size},
                             {"peers", row.peers ? row.peers : 1},
                             {"ratio_samples", row.samples},
                             {"raw_cpu_us_per_op", row.raw_cpu_us},
                             {"engine_cpu_us_per_op", row.engine_cpu_us},
                             {"engine_submitter_cpu_us_per_op", row.engine_caller_cpu_us},
                             {"raw_gbps", row.raw_gbps},
                             {"engine_gbps", row.engine_gbps},
                             {"ratio", row.ratio()},
                             {"median_ratio", row.median_ratio()},
                             {"raw_ops_per_s", row.raw_ops},
                             {"engine_ops_per_s", row.engine_ops}});
        j["rows"].back()["ratio_quartiles"] = {row.quantile_ratio(0.25), row.quantile_ratio(0.75)};
    }
    j["repeat"] = r.repeat;
    j["engine_posts"] = {{"ops", r.ops_posted},
                         {"worker_passes", r.post_rounds},
                         {"injected", r.ops_injected},
                         {"with_fi_more", r.posted_with_more},
                         {"bytes_per_rail", r.bytes_per_rail}};
    j["yardsticks"] = nlohmann::json::object();
    for (const XferYardstick& y : r.yardsticks) {
        j["yardsticks"][y.name] = {
            {"what", y.what}, {"unit", y.unit}, {"value", y.value}, {"raw", y.raw}};
        if (y.unit == "us") j["yardsticks"][y.name]["p99"] = y.p99;
    }
    j["latency_us"] = {{"p50", r.latency_p50_us},
                       {"p99", r.latency_p99_us},
                       {"raw_p50", r.raw_latency_p50_us},
                       {"iterations", r.latency_iters},
                       {"size_bytes", r.latency_size},
                       {"waited_p50", r.waited_latency_p50_us},
                       {"waited_p99", r.waited_latency_p99_us}};
    return j;
}

}  // namespace ferry
