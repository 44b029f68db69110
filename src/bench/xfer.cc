#include "bench/xfer.h"

#include <fmt/format.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "bench/raw_endpoint.h"
#include "ferry/common/bytes.h"
#include "ferry/fabric/engine.h"

namespace ferry {
namespace {

constexpr uint32_t kPing = 0x50494e47;
constexpr uint32_t kPong = 0x504f4e47;
const Duration kWait = std::chrono::seconds(30);

// Parent <-> target control channel over a socketpair: length-prefixed frames.
bool send_frame(int fd, std::span<const uint8_t> b) {
    uint32_t n = static_cast<uint32_t>(b.size());
    std::vector<uint8_t> f(reinterpret_cast<uint8_t*>(&n), reinterpret_cast<uint8_t*>(&n) + 4);
    f.insert(f.end(), b.begin(), b.end());
    size_t off = 0;
    while (off < f.size()) {
        ssize_t w = ::write(fd, f.data() + off, f.size() - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        off += w;
    }
    return true;
}

bool recv_frame(int fd, std::vector<uint8_t>* out) {
    auto read_all = [fd](void* p, size_t n) {
        auto* c = static_cast<uint8_t*>(p);
        while (n) {
            ssize_t r = ::read(fd, c, n);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) return false;
            c += r;
            n -= r;
        }
        return true;
    };
    uint32_t n = 0;
    if (!read_all(&n, 4)) return false;
    out->resize(n);
    return read_all(out->data(), n);
}

struct Sizes {
    size_t slot = 0;     // bytes per rotating slot
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
    // A benchmark dedicates a core to each worker, as a serving process would.
    e.busy_poll = true;
    return e;
}

// ---- target process -------------------------------------------------------------------

int target_main(int fd, const XferBenchConfig& c) {
    Sizes sz = buffer_sizes(c);
    std::vector<uint8_t> buf(sz.buffer, 0);
    EngineConfig ec = engine_config(c);
    // The target drives receive progress (shm copies large writes on the receiving side, tcp
    // reads its sockets there), so it polls all the time, as the raw loop's target does.
    ec.busy_poll = true;
    // Phase 1: the raw endpoint, progressed by this thread until the parent says next.
    {
        auto raw = detail::RawEndpoint::open(ec, buf.data(), buf.size());
        ByteWriter w;
        w.put<uint8_t>(raw.ok());
        if (raw.ok()) {
            w.put_bytes((*raw)->name());
            w.put((*raw)->wire_base());
            w.put((*raw)->key());
        } else {
            w.put_string(raw.status().to_string());
        }
        if (!send_frame(fd, w.bytes()) || !raw.ok()) return 1;
        std::atomic<bool> stop{false};
        std::thread poller([&] {
            while (!stop.load(std::memory_order_relaxed)) (*raw)->progress();
        });
        std::vector<uint8_t> cmd;
        bool ok = recv_frame(fd, &cmd);
        stop = true;
        poller.join();
        if (!ok) return 1;
    }
    // Phase 2: the engine; answers pings from a completion callback.
    auto engine = TransferEngine::create(ec);
    std::unique_ptr<MemoryRegion> mr;
    ByteWriter w;
    if (engine.ok()) {
        auto r = (*engine)->register_memory(buf.data(), buf.size());
        if (r.ok()) mr = std::move(*r);
    }
    w.put<uint8_t>(engine.ok() && mr);
    if (engine.ok() && mr) {
        (*engine)->address().encode(w);
        mr->descriptor().encode(w);
    } else {
        w.put_string(engine.ok() ? "registering target memory failed"
                                 : engine.status().to_string());
    }
    if (!send_frame(fd, w.bytes()) || !engine.ok() || !mr) return 1;
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
    std::function<void(const Status&)> pong = [&](const Status& s) {
        if (!s.ok()) return;  // shutdown
        eng->write({pid, region, 0, &parent_desc, 0, 8, kPong});
        eng->on_imm(kPing, 1, std::chrono::hours(1), pong);
    };
    eng->on_imm(kPing, 1, std::chrono::hours(1), pong);
    std::vector<uint8_t> cmd;
    recv_frame(fd, &cmd);  // parent done (or gone)
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
    void note(const std::string& s) {
        if (c_.progress) c_.progress(s);
    }
    Status raw_phase(XferReport& rep);
    Status engine_phase(XferReport& rep);
    Result<double> windowed(int window, const std::function<void(uint64_t, OpCallback)>& submit,
                            uint64_t* completed);
    Result<double> engine_write_loop(size_t size, int window, uint64_t* ops);
    Result<double> engine_paged_loop(size_t page, uint64_t* pages_done);
    Status latency(XferReport& rep);

    XferBenchConfig c_;
    int fd_;
    Sizes sz_;
    std::vector<uint8_t> buf_;
    std::unique_ptr<TransferEngine> engine_;
    std::unique_ptr<MemoryRegion> mr_;
    PeerId peer_ = 0;
    MemoryDescriptor remote_;
};

Duration point_duration(const XferBenchConfig& c) {
    return std::chrono::duration_cast<Duration>(
        std::chrono::duration<double>(c.seconds_per_point));
}

// Every set-up frame from the target starts with an ok byte, followed by its error on failure.
Status read_target_status(ByteReader& rd) {
    uint8_t ok = 0;
    FERRY_RETURN_IF_ERROR(rd.get(&ok, "ok"));
    if (ok) return ok_status();
    std::string why;
    (void)rd.get_string(&why, "error", 4096);
    return unavailable("bench target: " + why);
}

Status Initiator::raw_phase(XferReport& rep) {
    std::vector<uint8_t> blob;
    if (!recv_frame(fd_, &blob)) return unavailable("bench target died during set-up");
    ByteReader rd(blob);
    FERRY_RETURN_IF_ERROR(read_target_status(rd));
    std::vector<uint8_t> name;
    uint64_t base = 0, key = 0;
    FERRY_RETURN_IF_ERROR(rd.get_bytes(&name, "name", 1024));
    FERRY_RETURN_IF_ERROR(rd.get(&base, "base"));
    FERRY_RETURN_IF_ERROR(rd.get(&key, "key"));
    FERRY_ASSIGN_OR_RETURN(auto raw,
                           detail::RawEndpoint::open(engine_config(c_), buf_.data(), buf_.size()));
    FERRY_ASSIGN_OR_RETURN(fi_addr_t dest, raw->insert(name));
    Duration d = point_duration(c_);
    for (size_t size : c_.sizes) {
        FERRY_ASSIGN_OR_RETURN(double bps, raw->write_loop(dest, base, key, size, c_.window,
                                                           sz_.slots, d));
        rep.rows.push_back({"write", size, bps / 1e9, 0, bps / size, 0});
        note(fmt::format("raw fi_write {:>8} B: {:.2f} GB/s", size, bps / 1e9));
    }
    for (size_t page : c_.pages) {
        // The ceiling for paged writes is the plain loop at the page size, with destinations
        // spread over the same region the paged writes scatter into.
        int slots = static_cast<int>(std::min<size_t>(sz_.buffer / page, 1024));
        FERRY_ASSIGN_OR_RETURN(double bps,
                               raw->write_loop(dest, base, key, page, c_.window, slots, d));
        rep.rows.push_back({"paged write", page, bps / 1e9, 0, bps / page, 0});
        note(fmt::format("raw fi_write {:>8} B pages: {:.2f} GB/s", page, bps / 1e9));
    }
    FERRY_ASSIGN_OR_RETURN(double sbps, raw->write_loop(dest, base, key, 64, 256, 64, d));
    rep.rows.push_back({"small write", 64, sbps / 1e9, 0, sbps / 64, 0});
    note(fmt::format("raw fi_write 64 B: {:.2f} Mops/s", sbps / 64 / 1e6));
    // Raw one-way latency: a window of one.
    FERRY_ASSIGN_OR_RETURN(double lbps, raw->write_loop(dest, base, key, 8, 1, 1, d / 2));
    rep.raw_latency_p50_us = lbps > 0 ? 1e6 * 8 / lbps / 2 : 0;
    return ok_status();
}

// Keeps up to `window` operations in flight for one measurement period: `submit(n, cb)`
// posts the n-th operation with completion cb. Returns operations completed per second.
// The submitter sleeps until half the window drained: one wake-up per half window instead
// of one per operation.
Result<double> Initiator::windowed(int window,
                                   const std::function<void(uint64_t, OpCallback)>& submit,
                                   uint64_t* completed) {
    std::atomic<int> inflight{0};
    std::atomic<uint64_t> done{0};
    std::atomic<bool> failed{false};
    Status first_error;
    std::mutex err_mu;
    auto cb = [&](const Status& s) {
        if (!s.ok()) {
            std::lock_guard lk(err_mu);
            if (first_error.ok()) first_error = s;
            failed = true;
        }
        done.fetch_add(1, std::memory_order_relaxed);
        if (inflight.fetch_sub(1, std::memory_order_acq_rel) - 1 == window / 2) {
            inflight.notify_one();
        }
    };
    auto start = Clock::now();
    auto stop = start + point_duration(c_);
    uint64_t posted = 0;
    while (!failed) {
        int cur = inflight.load(std::memory_order_acquire);
        if (cur >= window) {
            while (cur > window / 2) {
                inflight.wait(cur, std::memory_order_acquire);
                cur = inflight.load(std::memory_order_acquire);
            }
            continue;
        }
        if (Clock::now() >= stop) break;
        inflight.fetch_add(1, std::memory_order_relaxed);
        submit(posted++, cb);
    }
    auto deadline = deadline_after(kWait);
    while (inflight.load() > 0 && Clock::now() < deadline) std::this_thread::yield();
    if (inflight.load() > 0) return timeout_error("bench: operations still in flight after 30 s");
    if (failed) return first_error;
    double secs = std::chrono::duration<double>(Clock::now() - start).count();
    *completed = done.load();
    return static_cast<double>(*completed) / secs;
}

Result<double> Initiator::engine_write_loop(size_t size, int window, uint64_t* ops) {
    FERRY_ASSIGN_OR_RETURN(double per_s, windowed(window, [&](uint64_t n, OpCallback cb) {
        size_t slot = n % sz_.slots;
        engine_->write({peer_, mr_.get(), slot * size, &remote_, slot * size, size, std::nullopt},
                       std::move(cb));
    }, ops));
    return per_s * static_cast<double>(size);
}

Result<double> Initiator::engine_paged_loop(size_t page, uint64_t* pages_done) {
    // Random, non-adjacent page lists (every other page), as a paged KV cache's blocks are:
    // nothing coalesces, so this measures the per-page cost.
    uint32_t npages = static_cast<uint32_t>(sz_.buffer / page / 2);
    std::mt19937 rng(7);
    std::vector<std::vector<uint32_t>> lists(16);
    for (auto& l : lists) {
        std::vector<uint32_t> perm(npages);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int i = 0; i < c_.pages_per_op; ++i) l.push_back(perm[i] * 2);
    }
    int window_ops = std::max(1, c_.window / c_.pages_per_op) * 2;
    uint64_t ops = 0;
    FERRY_ASSIGN_OR_RETURN(double per_s, windowed(window_ops, [&](uint64_t n, OpCallback cb) {
        PagedWriteOp p;
        p.peer = peer_;
        p.src = mr_.get();
        p.dst = &remote_;
        p.page_size = page;
        p.src_pages = lists[n % lists.size()];
        p.dst_pages = lists[(n + 5) % lists.size()];
        engine_->paged_write(p, std::move(cb));
    }, &ops));
    *pages_done = ops * c_.pages_per_op;
    return per_s * c_.pages_per_op * static_cast<double>(page);
}

Status Initiator::latency(XferReport& rep) {
    // The whole ping-pong runs in completion callbacks on the worker thread, so no other
    // thread competes for a core while it is timed.
    struct State {
        std::mutex mu;
        std::condition_variable cv;
        int left = 0;
        int warmup = 0;
        TimePoint t0;
        std::vector<double> us;
        bool done = false;
        Status error;
    } st;
    st.warmup = std::min(200, c_.latency_iters / 10);
    st.left = c_.latency_iters + st.warmup;
    st.us.reserve(st.left);
    std::function<void(const Status&)> on_pong = [&](const Status& s) {
        auto now = Clock::now();
        if (!s.ok()) {
            std::lock_guard lk(st.mu);
            st.error = s;
            st.done = true;
            st.cv.notify_all();
            return;
        }
        if (st.warmup > 0) --st.warmup;
        else st.us.push_back(to_us(now - st.t0) / 2);
        if (--st.left == 0) {
            std::lock_guard lk(st.mu);
            st.done = true;
            st.cv.notify_all();
            return;
        }
        engine_->on_imm(kPong, 1, std::chrono::seconds(5), on_pong);
        st.t0 = Clock::now();
        engine_->write({peer_, mr_.get(), 0, &remote_, 0, 8, kPing});
    };
    engine_->on_imm(kPong, 1, std::chrono::seconds(5), on_pong);
    st.t0 = Clock::now();
    engine_->write({peer_, mr_.get(), 0, &remote_, 0, 8, kPing});
    std::unique_lock lk(st.mu);
    if (!st.cv.wait_for(lk, std::chrono::seconds(60), [&] { return st.done; })) {
        return timeout_error("latency: ping-pong did not finish within 60 s");
    }
    if (!st.error.ok()) return st.error.with_context("latency ping-pong");
    std::sort(st.us.begin(), st.us.end());
    rep.latency_p50_us = st.us[st.us.size() / 2];
    rep.latency_p99_us = st.us[std::min(st.us.size() - 1, st.us.size() * 99 / 100)];
    rep.latency_iters = c_.latency_iters;
    return ok_status();
}

Status Initiator::engine_phase(XferReport& rep) {
    if (!send_frame(fd_, {})) return unavailable("bench target is gone");  // next phase
    std::vector<uint8_t> blob;
    if (!recv_frame(fd_, &blob)) return unavailable("bench target died starting its engine");
    ByteReader rd(blob);
    FERRY_RETURN_IF_ERROR(read_target_status(rd));
    FERRY_ASSIGN_OR_RETURN(auto taddr, EngineAddress::decode(rd));
    FERRY_ASSIGN_OR_RETURN(remote_, MemoryDescriptor::decode(rd));
    FERRY_ASSIGN_OR_RETURN(engine_, TransferEngine::create(engine_config(c_)));
    FERRY_ASSIGN_OR_RETURN(mr_, engine_->register_memory(buf_.data(), buf_.size()));
    FERRY_ASSIGN_OR_RETURN(peer_, engine_->connect(taddr));
    ByteWriter w;
    engine_->address().encode(w);
    mr_->descriptor().encode(w);
    if (!send_frame(fd_, w.bytes())) return unavailable("bench target is gone");

    size_t row = 0;
    for (size_t size : c_.sizes) {
        uint64_t ops = 0;
        FERRY_ASSIGN_OR_RETURN(double bps, engine_write_loop(size, c_.window, &ops));
        rep.rows[row].engine_gbps = bps / 1e9;
        rep.rows[row].engine_ops = bps / size;
        note(fmt::format("engine write {:>8} B: {:.2f} GB/s ({:.2f}x raw)", size, bps / 1e9,
                         rep.rows[row].ratio()));
        ++row;
    }
    for (size_t page : c_.pages) {
        uint64_t pages = 0;
        FERRY_ASSIGN_OR_RETURN(double bps, engine_paged_loop(page, &pages));
        rep.rows[row].engine_gbps = bps / 1e9;
        rep.rows[row].engine_ops = bps / page;
        note(fmt::format("engine paged {:>8} B pages: {:.2f} GB/s ({:.2f}x raw)", page, bps / 1e9,
                         rep.rows[row].ratio()));
        ++row;
    }
    uint64_t ops = 0;
    FERRY_ASSIGN_OR_RETURN(double sbps, engine_write_loop(64, 256, &ops));
    rep.rows[row].engine_gbps = sbps / 1e9;
    rep.rows[row].engine_ops = sbps / 64;
    note(fmt::format("engine write 64 B: {:.2f} Mops/s", sbps / 64 / 1e6));
    FERRY_RETURN_IF_ERROR(latency(rep));
    note(fmt::format("engine write+imm latency: p50 {:.1f} us, p99 {:.1f} us", rep.latency_p50_us,
                     rep.latency_p99_us));
    return ok_status();
}

Result<XferReport> Initiator::run() {
    XferReport rep;
    FERRY_ASSIGN_OR_RETURN(rep.provider, resolve_provider(engine_config(c_)));
    FERRY_RETURN_IF_ERROR(raw_phase(rep));
    FERRY_RETURN_IF_ERROR(engine_phase(rep));
    return rep;
}

}  // namespace

Result<XferReport> run_xfer_bench(const XferBenchConfig& config) {
    if (config.sizes.empty()) return invalid_argument("bench xfer: no sizes given");
    if (config.window < 1 || config.pages_per_op < 1) {
        return invalid_argument("bench xfer: window and pages per op must be positive");
    }
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
        return unavailable(std::string("socketpair: ") + std::strerror(errno));
    }
    std::fflush(stdout);
    std::fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) return unavailable(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
        ::close(sv[0]);
        _exit(target_main(sv[1], config));
    }
    ::close(sv[1]);
    Result<XferReport> rep = [&]() -> Result<XferReport> {
        Initiator init(config, sv[0]);
        return init.run();
    }();
    send_frame(sv[0], {});  // tells the target to finish
    ::close(sv[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    if (rep.ok() && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        return internal_error("bench target exited abnormally");
    }
    return rep;
}

namespace {
std::string human_size(size_t b) {
    if (b >= (1u << 20) && b % (1u << 20) == 0) return fmt::format("{} MiB", b >> 20);
    if (b >= 1024 && b % 1024 == 0) return fmt::format("{} KiB", b >> 10);
    return fmt::format("{} B", b);
}
}  // namespace

std::string format_xfer_table(const XferReport& r) {
    std::string out = fmt::format("ferry bench xfer — provider {} (two processes, one host)\n\n",
                                  r.provider);
    out += fmt::format("{:<12} {:>9} {:>12} {:>12} {:>7} {:>14}\n", "operation", "size",
                       "raw GB/s", "engine GB/s", "ratio", "engine ops/s");
    for (const auto& row : r.rows) {
        out += fmt::format("{:<12} {:>9} {:>12.2f} {:>12.2f} {:>6.2f}x {:>14.0f}\n", row.kind,
                           human_size(row.size), row.raw_gbps, row.engine_gbps, row.ratio(),
                           row.engine_ops);
    }
    out += fmt::format("\nwrite with immediate, 8 B, one-way (half round trip, {} iterations): "
                       "p50 {:.1f} us, p99 {:.1f} us (raw fi_write, window 1: {:.1f} us)\n",
                       r.latency_iters, r.latency_p50_us, r.latency_p99_us,
                       r.raw_latency_p50_us);
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
                             {"raw_gbps", row.raw_gbps},
                             {"engine_gbps", row.engine_gbps},
                             {"ratio", row.ratio()},
                             {"raw_ops_per_s", row.raw_ops},
                             {"engine_ops_per_s", row.engine_ops}});
    }
    j["latency_us"] = {{"p50", r.latency_p50_us},
                       {"p99", r.latency_p99_us},
                       {"raw_p50", r.raw_latency_p50_us},
                       {"iterations", r.latency_iters}};
    return j;
}

}  // namespace ferry
