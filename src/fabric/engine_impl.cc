// EngineImpl: construction (provider, rails, address), the watchdog, shutdown, and the entry
// points that hand each request to the component owning its state.
#include "fabric/engine_impl.h"

#include <dirent.h>
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <unordered_map>

#include "fabric/provider.h"
#include "ferry/common/log.h"
#include "ferry/common/thread_name.h"

namespace ferry::detail {
namespace {

std::string read_host_id() {
    std::string boot;
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::getline(f, boot);
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    return std::string(host) + "/" + boot;
}

uint64_t random_engine_id() {
    std::random_device rd;
    uint64_t id = (uint64_t{rd()} << 32) ^ rd() ^ (uint64_t(getpid()) << 16);
    return id ? id : 1;
}

}  // namespace

namespace {
// The engines this process opened, by id, and whether each is still open. Connecting to one
// that was shut down crashed inside libfabric 1.17's shm provider (fi_av_insert, SIGSEGV on
// the engine's worker) when it was that engine's first peer; no provider can reach it anyway.
// Never destroyed: an engine may shut down during static destruction (a Python exit).
struct LocalEngines {
    std::mutex mu;
    std::unordered_map<uint64_t, bool> open;
};
LocalEngines& local_engines() {
    static LocalEngines& engines = *std::make_unique<LocalEngines>().release();
    return engines;
}
void note_local_engine(uint64_t id, bool open) {
    LocalEngines& l = local_engines();
    std::lock_guard lk(l.mu);
    if (open || l.open.count(id)) l.open[id] = open;
}
// Whether `id` names an engine of this process that was shut down.
bool local_engine_closed(uint64_t id) {
    LocalEngines& l = local_engines();
    std::lock_guard lk(l.mu);
    auto it = l.open.find(id);
    return it != l.open.end() && !it->second;
}
}  // namespace

namespace {
// shm regions of engines whose process is gone (killed with SIGKILL, crashed) stay in
// /dev/shm, a few MB each. Every new shm engine removes those whose owner no longer exists;
// a live process, or a zombie not reaped yet, keeps its regions.
void remove_stale_shm_regions() {
    DIR* d = opendir("/dev/shm");
    if (!d) return;
    size_t prefix_len = std::strlen(kShmNamePrefix);
    while (dirent* e = readdir(d)) {
        if (std::strncmp(e->d_name, kShmNamePrefix, prefix_len) != 0) continue;
        char* end = nullptr;
        long pid = std::strtol(e->d_name + prefix_len, &end, 10);
        if (pid <= 0 || !end || *end != '_') continue;
        if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
            ::unlink((std::string("/dev/shm/") + e->d_name).c_str());
        }
    }
    closedir(d);
}
}  // namespace

Status EngineImpl::init(const EngineConfig& cfg) {
    config = cfg;
    if (config.num_rails < 1 || config.num_rails > 32) {
        return invalid_argument(fmt::format("num_rails must be 1..32, got {}", config.num_rails));
    }
    if (config.max_message_size < 64) return invalid_argument("max_message_size must be >= 64");
    // 0 split every write into pieces of 0 bytes for ever (a hang at the first write); an
    // op_timeout of 0 failed every operation before it could be posted.
    if (config.max_write_size == 0) return invalid_argument("max_write_size must be > 0 bytes");
    if (config.rma_iovs == 0) {
        return invalid_argument("rma_iovs must be >= 1 (runs per fabric operation), got 0");
    }
    if (config.op_timeout <= Duration::zero()) {
        return invalid_argument(
            fmt::format("op_timeout must be > 0, got {:.0f} ms", to_ms(config.op_timeout)));
    }
    if (config.gpu_copy != "auto" && config.gpu_copy != "kernel" &&
        config.gpu_copy != "copy-engine") {
        return invalid_argument(
            fmt::format("gpu_copy must be \"auto\", \"kernel\" or \"copy-engine\", got \"{}\"",
                        config.gpu_copy));
    }
    FERRY_ASSIGN_OR_RETURN(provider, resolve_provider_name(config));
    FERRY_ASSIGN_OR_RETURN(auto infos, get_infos(provider, config));
    bool fabric_gpu = false;
    std::string fabric_gpu_note;
    if (config.fabric_gpu_memory) {
        // Only a provider that can register CUDA memory gets FI_HMEM domains: host memory
        // then travels exactly as before on every other one.
        CudaHmem h = probe_cuda_hmem(provider, config);
        fabric_gpu_note = std::move(h.note);
        if (h.infos) {
            infos = std::move(h.infos);
            fabric_gpu = true;
        }
    } else {
        fabric_gpu_note = fmt::format(
            "GPU memory over provider {} is off (EngineConfig::fabric_gpu_memory)", provider);
    }
    if (provider == "shm") remove_stale_shm_regions();
    std::vector<const fi_info*> candidates;
    for (const fi_info* i = infos.get(); i; i = i->next) {
        if (provider == i->fabric_attr->prov_name) candidates.push_back(i);
    }
    if (candidates.empty()) candidates.push_back(infos.get());

    address.engine_id = random_engine_id();
    config.shm_name_salt = address.engine_id;
    address.provider = provider;
    address.host_id = read_host_id();
    address.signal.engine_id = address.engine_id;
    cma_.configure(config.cma_writes, provider, address.engine_id, address.host_id);
    address.signal.length = 64;
    // Rail r opens candidates[r % n] (RailGroup::open): the NIC it stands for.
    std::vector<FabricNic> rail_nics;
    for (int r = 0; r < config.num_rails; ++r) {
        rail_nics.push_back(fabric_nic(candidates[r % candidates.size()]));
    }
    FERRY_ASSIGN_OR_RETURN(RailPlacement placement,
                           RailPlacement::open(config, std::move(rail_nics)));
    const std::vector<std::string> rail_lines = placement.rail_lines();
    memory_.configure({address.engine_id, provider, config.gpu_ipc, fabric_gpu,
                       std::move(fabric_gpu_note), config.op_timeout, std::move(placement)});

    Status opened = rails.open(candidates, config, [this](int r) {
        RailHooks hooks;
        hooks.on_imm = [this](uint32_t v) { imm.arrive(v); };
        hooks.stay_awake = [this] {
            return imm.has_waiters() || gpu_.busy() ||
                   expecting_.load(std::memory_order_relaxed) > 0;
        };
        hooks.expecting_since = [this]() -> std::optional<TimePoint> {
            if (expecting_signalled_.load(std::memory_order_relaxed) <= 0) return std::nullopt;
            return TimePoint(Duration(signalled_since_.load(std::memory_order_relaxed)));
        };
        if (r == 0) {
            hooks.on_message = [this](std::span<const uint8_t> m) { control_.deliver(m); };
        }
        return hooks;
    });
    FERRY_RETURN_IF_ERROR(opened);
    for (const auto& rail : rails) {
        address.rail_addrs.push_back(rail->name());
        address.signal.rail_keys.push_back(rail->signal_key());
    }
    // Immediate-only writes carry no bytes; the signal region is addressed by offset 0 of the
    // one 64-byte buffer every rail registered (RailGroup::open), under each rail's key.
    address.signal.virt_addr = rails[0].virt_addr();
    address.signal.base = reinterpret_cast<uint64_t>(rails[0].signal_base());
    rails.start();
    imm.set_first_waiter_hook([this] {
        {
            std::lock_guard lk(watchdog_mu_);
            watchdog_poke_ = true;
        }
        watchdog_cv_.notify_one();
    });
    watchdog_ = std::thread([this] {
        set_thread_name("ferry-watchdog");
        watchdog();
    });
    note_local_engine(address.engine_id, true);
    log(LogLevel::kInfo, "fabric", "engine {:x}: provider {}, {} rail(s); {}", address.engine_id,
        provider, rails.size(), memory_.fabric_gpu_note());
    // Greppable like NIXL's "Created rail": one line per rail, the NIC it stands for.
    for (const auto& line : rail_lines) {
        log(LogLevel::kInfo, "fabric", "engine {:x}: {}", address.engine_id, line);
    }
    return ok_status();
}

void EngineImpl::watchdog() {
    const Duration limit = wedge_threshold(config.op_timeout);
    // A wedge is a worker spinning inside the provider (shm on a dead peer's lock in shared
    // memory). A worker inside one call that hardly runs is blocked in the kernel instead: seen
    // with tcp;ofi_rxm while 64 engines and a 2-job build shared the 2-core machine, one call
    // for over 5 s at 55 ms of CPU per 2.5 s (2%). That call returns, so such a rail is not
    // given up; its operations keep their own deadlines. Spinning means at least a fifth of the
    // window on a core: a wedged shm worker spins flat out.
    constexpr double kSpinShare = 0.2;
    struct Window {
        TimePoint at;
        Duration cpu;
        bool warned = false;
    };
    std::vector<std::optional<Window>> windows(rails.size());
    while (!stopped_) {
        // Immediate waiters' deadlines are swept every millisecond; with none, the wedge checks
        // (thresholds of seconds) need no more than 50 ticks a second: a tick each millisecond
        // cost an idle engine ~2% of a core. A first waiter pokes the thread awake.
        {
            std::unique_lock lk(watchdog_mu_);
            watchdog_cv_.wait_for(
                lk,
                imm.has_waiters() ? std::chrono::milliseconds(1) : std::chrono::milliseconds(20),
                [&] { return watchdog_poke_ || stopped_.load(); });
            watchdog_poke_ = false;
        }
        if (stopped_) break;
        TimePoint now = Clock::now();
        imm.expire(now);
        for (auto& r : rails) {
            if (r->wedged()) continue;
            auto& w = windows[r->index()];
            if (!r->stuck_for(limit / 2, now)) {
                w.reset();
                continue;
            }
            auto cpu = r->worker_cpu_time();
            if (!w) w = Window{now, cpu.value_or(Duration::zero())};
            if (!r->stuck_for(limit, now) || now - w->at < limit / 2) continue;
            const Duration used = cpu ? *cpu - w->cpu : Duration::zero();
            const Duration span = now - w->at;
            if (cpu && used < span * kSpinShare) {
                if (!w->warned) {
                    log(LogLevel::kWarn, "fabric",
                        "rail {} ({}) has been inside one provider call for over {:.0f} ms, but "
                        "its worker used only {:.0f} ms of CPU in the last {:.0f} ms: a call "
                        "blocked on an overloaded host, not a wedge; its operations keep their "
                        "deadlines",
                        r->index(), provider, to_ms(limit), to_ms(used), to_ms(span));
                }
                w = Window{now, *cpu, true};  // judge the next window afresh
                continue;
            }
            r->mark_wedged();
            std::string spent =
                cpu ? fmt::format("; its worker used {:.0f} ms of CPU in the last {:.0f} ms",
                                  to_ms(used), to_ms(span))
                    : "";
            Status why = unavailable(fmt::format(
                "rail {} ({}) has been stuck inside one provider call for over {:.0f} ms{}, most "
                "likely because a peer died while holding a lock in shared memory; its "
                "operations are failed and it takes no new work: create a new engine",
                r->index(), provider, to_ms(limit), spent));
            log(LogLevel::kError, "fabric", "{}", why.message());
            if (!wedged_.load(std::memory_order_acquire)) {
                std::lock_guard lk(health_mu_);
                health_ = why;
                wedged_.store(true, std::memory_order_release);
            }
            fail_ops_on_rail(r->index(), why);
        }
    }
}

Status EngineImpl::health() const {
    if (!wedged_.load(std::memory_order_acquire)) return ok_status();
    std::lock_guard lk(health_mu_);
    return health_;
}

Status EngineImpl::wedge_rail_for_test(int rail, Duration limit) {
    if (rail < 0 || rail >= static_cast<int>(rails.size()))
        return invalid_argument(fmt::format("no rail {}", rail));
    Rail* r = &rails[rail];
    const TimePoint until = Clock::now() + limit;
    // The worker exits once its task returns on a wedged rail, without answering: the caller
    // watches the rail, not the task, and returns as soon as the watchdog declared it.
    auto ended = std::make_shared<std::atomic<bool>>(false);
    OpRef task = r->post_task(
        [r, until] {
            CallGuard g(r->call_monitor());
            while (!r->wedged() && Clock::now() < until) {
            }
            return ok_status();
        },
        [ended](const Status&) { ended->store(true); });
    while (!r->wedged() && Clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (r->wedged()) return ok_status();  // the worker never touches the task again
    while (!ended->load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return timeout_error("the watchdog never saw the wedge");
}

void EngineImpl::fail_ops_on_rail(int rail, const Status& why) {
    std::vector<OpRef> victims;
    {
        std::lock_guard lk(registry_->mu);
        registry_->for_each([&](OpState* op) {
            if (!(op->rail_mask & (uint64_t{1} << rail))) return;
            // The last owner may be letting go right now: it then needs no failing.
            if (op->try_add_ref()) victims.push_back(OpRef::adopt(op));
        });
    }
    for (auto& op : victims) op->fail_now(why);
}

void EngineImpl::shutdown() {
    if (stopped_.exchange(true)) return;
    note_local_engine(address.engine_id, false);
    Status why = cancelled("the transfer engine was shut down");
    // Pending GPU copies fail first; their callbacks may still signal through the rails.
    gpu_.shutdown();
    { std::lock_guard lk(watchdog_mu_); }
    watchdog_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    rails.stop(why);
    imm.cancel_all(why);
    cma_.withdraw_all(config.op_timeout);
    memory_.close_all();
    rails.release();
}

EngineImpl::~EngineImpl() { shutdown(); }

namespace {

// A range register_memory takes: not empty, not wrapping past the end of the address space (a
// raw (ptr, nbytes) from Python with nbytes 2^64 - 1 was taken, and every offset passed the
// range checks of the peers' writes and reads).
Status check_range(const void* ptr, size_t len) {
    if (!ptr || len == 0) {
        return invalid_argument(fmt::format("cannot register {} bytes at {}", len, ptr));
    }
    if (len > UINTPTR_MAX - reinterpret_cast<uintptr_t>(ptr)) {
        return invalid_argument(fmt::format(
            "cannot register {} bytes at {}: the range wraps past the end of the address space",
            len, ptr));
    }
    return ok_status();
}

}  // namespace

std::unique_ptr<MemoryRegion> EngineImpl::region_of(MemoryRegistry::Registration reg, void* ptr,
                                                    size_t len, RemoteAccess access) {
    std::unique_ptr<MemoryRegion> region(new MemoryRegion());
    region->engine_ = shared_from_this();
    region->id_ = reg.id;
    region->ptr_ = ptr;
    region->len_ = len;
    region->desc_ = std::move(reg.desc);
    region->local_descs_ = std::move(reg.local_descs);
    region->access_ = access;
    cma_.offer(&region->desc_, access);
    return region;
}

Result<std::unique_ptr<MemoryRegion>> EngineImpl::register_memory(void* ptr, size_t len,
                                                                  MemoryKind kind, int device,
                                                                  RemoteAccess access) {
    if (stopped_) return cancelled("the transfer engine was shut down");
    FERRY_RETURN_IF_ERROR(check_range(ptr, len));
    FERRY_ASSIGN_OR_RETURN(MemoryRegistry::Registration reg,
                           memory_.add(ptr, len, kind, device, access));
    return region_of(std::move(reg), ptr, len, access);
}

Result<std::vector<std::unique_ptr<MemoryRegion>>> EngineImpl::register_memory(
    std::span<const std::span<uint8_t>> ranges, MemoryKind kind, int device, RemoteAccess access) {
    if (stopped_) return cancelled("the transfer engine was shut down");
    for (size_t i = 0; i < ranges.size(); ++i) {
        Status s = check_range(ranges[i].data(), ranges[i].size());
        if (!s.ok()) return s.with_context(fmt::format("range {} of {}", i, ranges.size()));
    }
    FERRY_ASSIGN_OR_RETURN(std::vector<MemoryRegistry::Registration> regs,
                           memory_.add(ranges, kind, device, access));
    std::vector<std::unique_ptr<MemoryRegion>> out;
    out.reserve(regs.size());
    for (size_t i = 0; i < regs.size(); ++i)
        out.push_back(region_of(std::move(regs[i]), ranges[i].data(), ranges[i].size(), access));
    return out;
}

void EngineImpl::deregister(uint32_t id, const MemoryDescriptor& desc) {
    cma_.withdraw(desc, config.op_timeout);
    memory_.remove(id);
}

void EngineImpl::when_released(std::vector<std::span<const uint8_t>> spans, Duration timeout,
                               std::function<void(size_t)> then) {
    // Sorted and merged once here; each rail searches them for every operation it holds.
    std::sort(spans.begin(), spans.end(),
              [](const auto& a, const auto& b) { return a.data() < b.data(); });
    std::vector<std::span<const uint8_t>> merged;
    for (const auto& sp : spans) {
        if (sp.empty()) continue;
        if (!merged.empty() && sp.data() <= merged.back().data() + merged.back().size()) {
            const uint8_t* end =
                std::max(merged.back().data() + merged.back().size(), sp.data() + sp.size());
            merged.back() = {merged.back().data(), static_cast<size_t>(end - merged.back().data())};
        } else {
            merged.push_back(sp);
        }
    }
    struct Countdown {
        std::atomic<size_t> rails_left;
        std::atomic<size_t> held{0};
        std::function<void(size_t)> then;
        void rail_done(size_t n) {
            held.fetch_add(n);
            if (rails_left.fetch_sub(1) == 1) then(held.load());
        }
    };
    std::vector<Rail*> live;
    for (size_t r = 0; r < rails.size(); ++r) {
        if (!rails[r].wedged()) live.push_back(&rails[r]);
    }
    if (merged.empty() || live.empty() || stopped_) return then(0);
    auto cd = std::make_shared<Countdown>();
    cd->rails_left = live.size();
    cd->then = std::move(then);
    const TimePoint deadline = deadline_after(timeout);
    for (Rail* rail : live) {
        auto reported = std::make_shared<std::atomic<bool>>(false);
        auto once = [cd, reported](size_t n) {
            if (!reported->exchange(true)) cd->rail_done(n);
        };
        rail->post_task(
            [rail, merged, deadline, once] {
                rail->watch_release(merged, deadline, once);
                return ok_status();
            },
            // The task never ran (the rail stopped): its endpoints are closed, nothing is held.
            [once](const Status& s) {
                if (!s.ok()) once(0);
            });
    }
}

Result<PeerId> EngineImpl::connect(const EngineAddress& a) {
    if (stopped_) return cancelled("the transfer engine was shut down");
    if (a.provider != provider) {
        return invalid_argument(fmt::format(
            "peer engine {:x} uses provider '{}' but this engine uses '{}'; both sides must "
            "open the same provider",
            a.engine_id, a.provider, provider));
    }
    if (a.rail_addrs.empty()) return invalid_argument("peer address has no rails");
    if (a.host_id == address.host_id && local_engine_closed(a.engine_id)) {
        return unavailable(
            fmt::format("engine {:x} of this process was shut down: connect to the address of "
                        "a live engine",
                        a.engine_id));
    }
    return peers_.connect(a, rails, address.engine_id);
}

std::optional<PeerId> EngineImpl::find_peer(uint64_t engine_id) const {
    return peers_.find(engine_id);
}

Result<GroupId> EngineImpl::create_group(std::span<const PeerId> peers,
                                         std::span<const MemoryDescriptor> dsts) {
    return peers_.create_group(peers, dsts);
}

void EngineImpl::expect_arrivals(bool on, Expected what) {
    std::atomic<int32_t>& open = what == Expected::kAny ? expecting_ : expecting_signalled_;
    if (!on) {
        open.fetch_sub(1, std::memory_order_relaxed);
        return;
    }
    if (what == Expected::kSignalled)
        signalled_since_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
    if (open.fetch_add(1, std::memory_order_relaxed) == 0) rails.wake_all();
}

void EngineImpl::set_message_handler(MessageHandler handler) {
    control_.set_handler(std::move(handler));
}

std::vector<EngineStats> EngineImpl::rail_stats() const { return rails.rail_stats(); }

EngineStats EngineImpl::stats() const {
    EngineStats s = rails.stats();
    s.messages_dropped += control_.dropped();
    s.regions_registered = memory_.count();
    s.rail_fallbacks = rail_fallbacks_.load(std::memory_order_relaxed);
    s.cma_bytes = cma_.bytes();
    return s;
}

}  // namespace ferry::detail
