// One rail: a libfabric domain with its endpoint, completion queue and address vector, owned
// by one worker thread (FI_THREAD_DOMAIN). Other threads hand it work through a lock-free
// queue; only the worker calls into libfabric after start().
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_rma.h>
#include <time.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "fabric/mpsc_queue.h"
#include "fabric/op_pool.h"
#include "fabric/op_state.h"
#include "fabric/provider.h"
#include "ferry/common/clock.h"
#include "ferry/common/spin.h"
#include "ferry/fabric/engine.h"

namespace ferry::detail {

// "what failed: provider's words (rc)" as kProviderError.
Status fi_status(const char* what, int rc);

// Every libfabric context we hand out starts with this, so a completion can tell what it is.
// Not initialised in a FabricOp: the worker fills kind and op when it posts with a context.
struct FabricOp;
struct FabricCtx {
    fi_context2 fi;  // first member: libfabric writes into it and returns its address
    enum Kind : uint8_t { kOp = 1, kRecv = 2 } kind;
    FabricOp* op;  // the owner, for kOp
};

// What a control message or a worker task carries besides the common fields.
struct FabricOpExtra {
    std::vector<uint8_t> payload;  // kSend: message bytes until copied to a slot
    std::function<Status()> task;  // kTask
};

// One fabric operation (or a task to run on the worker). Made by the submitting thread and
// read, posted and freed by the worker: every cache line of it that the submitting thread
// writes crosses to the worker's core and back. So what a write needs fits the first two lines
// (the queue link, the owner, the post's arguments, then the bookkeeping): the submitter
// writes those two and nothing else. The libfabric context, which only operations posted with
// a completion use, is on lines of its own that only the worker touches (the constructor
// leaves it alone), and a message's bytes or a task's function live in `extra`. Before, the
// constructor zeroed the context and built a vector and a std::function, so the submitter
// wrote all four lines of every operation and the worker fetched all four (see
// docs/BENCHMARKS.md, issue 18, third round). 64-byte aligned, recycled through OpPool.
inline constexpr size_t kFabricOpSharedBytes = 128;  // the lines both threads touch
// Local and remote iovecs one read or write may carry at most (one fi_writemsg or fi_readmsg):
// a paged write's runs of pages go up to this many to an operation where the provider takes
// them (tx_attr rma_iov_limit and iov_limit: 4 for shm and tcp;ofi_rxm in libfabric 1.17, 1
// for efa), so the provider handles a quarter of the commands.
inline constexpr size_t kMaxOpIovs = 4;
// The iovecs after the first, on the operation's last line: written by the submitter only for
// an operation that has them (FabricOp::more_iovs > 0), read by the worker only then. Lengths
// of 32 bits: a run joins an operation only if it is shorter than 4 GiB.
struct MoreIovs {
    void* local[kMaxOpIovs - 1];
    uint64_t raddr[kMaxOpIovs - 1];
    uint32_t len[kMaxOpIovs - 1];
};
struct alignas(64) FabricOp : MpscNode {
    enum Type : uint8_t { kWrite, kRead, kSend, kTask };
    // User-provided, so that `new FabricOp()` does not zero the whole block first (it would
    // with an implicit constructor) and leaves the context's lines alone.
    FabricOp() {}
    static void* operator new(size_t) {
        return OpPool<sizeof(FabricOp), alignof(FabricOp)>::allocate();
    }
    static void operator delete(void* p) {
        OpPool<sizeof(FabricOp), alignof(FabricOp)>::release(p);
    }

    // Line 0: the post's arguments. The operation this is a piece of; the pieces hold one
    // reference between them (see OpState::set_pieces), so a piece costs no count of its own.
    OpState* parent = nullptr;
    fi_addr_t dest = FI_ADDR_UNSPEC;
    void* local = nullptr;
    size_t len = 0;
    void* desc = nullptr;
    uint64_t raddr = 0;
    uint64_t rkey = 0;
    // Line 1.
    uint32_t imm = 0;
    Type type = kWrite;
    bool has_imm = false;
    bool abandoned = false;
    uint8_t more_iovs = 0;  // iovecs beyond the first (in `more`); same desc and rkey
    PeerId peer = 0;
    TimePoint deadline{};
    int slot = -1;                // kSend: registered send slot in use
    uint32_t tx_gen = 0;          // the initiator endpoint it was posted on (Rail::tx_gen_)
    FabricOp* in_prev = nullptr;  // the rail's pending or in-flight list (OpList)
    FabricOp* in_next = nullptr;
    std::unique_ptr<FabricOpExtra> extra;  // kSend and kTask only
    // Lines 2 and 3: the worker's alone.
    alignas(64) FabricCtx ctx;
    // Line 4: an operation of several iovecs only (left uninitialised otherwise).
    alignas(64) MoreIovs more;

    // Bytes the operation moves, all its iovecs together (`len` is the first one's).
    uint64_t bytes() const {
        uint64_t n = len;
        for (uint8_t i = 0; i < more_iovs; ++i) n += more.len[i];
        return n;
    }
    // Calls fn(local, raddr, len) for each iovec, the first one first.
    template <typename Fn>
    void for_each_iov(Fn&& fn) const {
        fn(local, raddr, static_cast<uint64_t>(len));
        for (uint8_t i = 0; i < more_iovs; ++i)
            fn(more.local[i], more.raddr[i], uint64_t{more.len[i]});
    }
};
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
static_assert(offsetof(FabricOp, extra) + sizeof(FabricOp::extra) <= kFabricOpSharedBytes,
              "what a write needs must fit the first two lines");
static_assert(offsetof(FabricOp, ctx) == kFabricOpSharedBytes,
              "the context starts on a line of its own");
static_assert(offsetof(FabricOp, more) == kFabricOpSharedBytes + 128 && sizeof(MoreIovs) <= 64,
              "the extra iovecs fill one line of their own, after the context");
#pragma GCC diagnostic pop

// The worker's lists of operations (popped and not yet posted; in flight, in post order),
// linked through the operations themselves: an operation is in at most one of them. Erasing
// from the middle (a peer that pushed back, a dead peer's, a timed-out one) costs two stores.
// The pending list was a std::deque, whose erase took ~115 instructions of the worker's ~1460
// per 64 B write with immediate (callgrind, shm, 2026-12-02).
struct OpList {
    FabricOp* head = nullptr;
    FabricOp* tail = nullptr;
    size_t size = 0;

    bool empty() const { return head == nullptr; }
    void push_back(FabricOp* op) {
        op->in_prev = tail;
        op->in_next = nullptr;
        if (tail)
            tail->in_next = op;
        else
            head = op;
        tail = op;
        ++size;
    }
    // Unlinks op and returns the one that followed it.
    FabricOp* erase(FabricOp* op) {
        FabricOp* next = op->in_next;
        if (op->in_prev)
            op->in_prev->in_next = next;
        else
            head = next;
        if (next)
            next->in_prev = op->in_prev;
        else
            tail = op->in_prev;
        op->in_prev = op->in_next = nullptr;
        --size;
        return next;
    }
    // Moves every operation of `front` before this list's, in their order.
    void splice_front(OpList& front) {
        if (front.empty()) return;
        front.tail->in_next = head;
        if (head)
            head->in_prev = front.tail;
        else
            tail = front.tail;
        head = front.head;
        size += front.size;
        front = OpList{};
    }
};

// Written by the rail's worker alone (see bump in rail.cc), read by any thread.
struct RailStats {
    std::atomic<uint64_t> ops_posted{0};
    std::atomic<uint64_t> ops_injected{0};      // posted with FI_INJECT
    std::atomic<uint64_t> posted_with_more{0};  // posted with FI_MORE (another op followed)
    std::atomic<uint64_t> post_rounds{0};       // worker passes that posted at least one op
    std::atomic<uint64_t> bytes_posted{0};
    std::atomic<uint64_t> eagain{0};
    std::atomic<uint64_t> op_errors{0};
    std::atomic<uint64_t> op_timeouts{0};
    std::atomic<uint64_t> imm_arrivals{0};
    std::atomic<uint64_t> messages_received{0};
    std::atomic<uint64_t> messages_dropped{0};
    std::atomic<uint64_t> initiator_renewals{0};  // fresh initiator endpoints opened
    std::atomic<uint64_t> dead_peer_failures{0};  // ops failed because the peer process is gone
    std::atomic<uint64_t> peer_addresses{0};      // in the address vector now (none leak)
};

// Tells the watchdog whether a rail's worker is stuck inside one provider call. The worker
// bumps a counter on entering and on leaving every call (odd: inside), two relaxed stores and
// no clock read; the watchdog notes when it last saw the counter change. Timing a whole pass
// of posts instead (one span, to save the two clock reads per post that were 2.4% of the
// worker's samples at 64 B writes, perf, shm, 2026-12-01) declared a healthy tcp rail wedged
// when a starved 2-core CI host stretched one pass past the 3 s op_timeout.
class CallMonitor {
  public:
    // Worker thread.
    void enter() {
        seq_.store(seq_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    }
    void leave() { enter(); }
    // Watchdog thread only: how long the worker has been inside the same call, as far as the
    // watchdog's observations tell (zero when it is outside any call or moved on since).
    Duration inside_for(TimePoint now) {
        uint64_t s = seq_.load(std::memory_order_relaxed);
        if (s != seen_) {
            seen_ = s;
            seen_at_ = now;
            return Duration::zero();
        }
        return (s & 1) ? now - seen_at_ : Duration::zero();
    }

  private:
    alignas(64) std::atomic<uint64_t> seq_{0};
    alignas(64) uint64_t seen_ = 0;  // watchdog's: the last value seen, and when it changed
    TimePoint seen_at_{};
};

// Marks one provider call for the watchdog (CallMonitor: two relaxed stores, no clock read).
class CallGuard {
  public:
    explicit CallGuard(CallMonitor& m) : m_(m) { m_.enter(); }
    ~CallGuard() { m_.leave(); }
    CallGuard(const CallGuard&) = delete;
    CallGuard& operator=(const CallGuard&) = delete;

  private:
    CallMonitor& m_;
};

// How often the worker sweeps deadlines (and closes idle retired endpoints).
inline constexpr auto kTickPeriod = std::chrono::milliseconds(1);
// The words of the timeout of an operation the provider pushed back until its deadline, by
// which never_posted() (ferry/fabric/engine.h) tells it from one that was posted.
inline constexpr const char* kNeverPostedText = "could not be posted within";

// Called by the worker for arrivals; set by the engine.
struct RailHooks {
    std::function<void(uint32_t imm)> on_imm;
    std::function<void(std::span<const uint8_t>)> on_message;
    // True while the engine expects arrivals soon (immediate waiters pending, GPU copies in
    // flight, a caller's expect_arrivals of kAny): the worker then keeps polling instead of
    // napping.
    std::function<bool()> stay_awake;
    // When the newest of a caller's open expect_arrivals of kSignalled began; nullopt when none
    // is open. The worker keeps polling for EngineConfig::expect_spin after the later of that
    // and its last activity, then naps as when idle.
    std::function<std::optional<TimePoint>()> expecting_since;
};

// What one Rail::run_on_worker call shares between its caller and the worker: the task, its
// result and how far it got. Owned by both (shared_ptr), so a task that finishes after its
// caller gave up writes here, never into the caller's frame, and releases what it produced.
class WorkerTask {
  public:
    enum Phase : int { kQueued, kRunning, kDone, kAbandoned };
    virtual ~WorkerTask() = default;
    // Worker: runs the task and keeps its result.
    virtual void run() = 0;
    // Worker: the caller gave up while the task ran; frees what it produced (an MR opened, an
    // address inserted), which nobody else will.
    virtual void release() = 0;
    std::atomic<int> phase{kQueued};
};

template <class T>
class WorkerTaskOf final : public WorkerTask {
  public:
    WorkerTaskOf(std::function<Result<T>()> fn, std::function<void(T&)> release)
        : fn_(std::move(fn)), release_(std::move(release)) {}
    void run() override { result_.emplace(fn_()); }
    void release() override {
        if (release_ && result_ && result_->ok()) release_(**result_);
    }
    // Caller, once the phase is kDone.
    Result<T> take() { return std::move(*result_); }

  private:
    std::function<Result<T>()> fn_;
    std::function<void(T&)> release_;
    std::optional<Result<T>> result_;
};

class Rail {
  public:
    // `signal_buf`: the engine's 64-byte signal buffer, one for all its rails (each registers
    // it), so that the one address its EngineAddress gives is inside every rail's key.
    static Result<std::unique_ptr<Rail>> open(int index, const fi_info* info,
                                              const EngineConfig& config, RailHooks hooks,
                                              std::shared_ptr<uint8_t[]> signal_buf);
    ~Rail();

    void start();
    // Fails everything in flight or queued with `why`, joins the worker, closes all objects.
    void stop(const Status& why);

    int index() const { return index_; }
    // Ends a nap at once (the engine's stay-awake condition changed).
    void wake();
    const std::vector<uint8_t>& name() const { return name_; }
    uint64_t mr_mode() const { return mr_mode_; }
    bool virt_addr() const { return (mr_mode_ & FI_MR_VIRT_ADDR) != 0; }
    // Iovecs one read or write on this rail may carry (1 to kMaxOpIovs): the provider's
    // rma_iov_limit and iov_limit, capped by EngineConfig::rma_iovs.
    size_t max_iovs() const { return max_iovs_; }
    // The same for one operation of `type`: 1 on shm for reads and for writes without an
    // immediate. shm copies those itself from the initiator (process_vm_readv/writev, its
    // "fast RMA") when they carry one remote iovec and no immediate; with several it sends
    // them to the target's worker as commands. Such a read under a key the target does not
    // honour blocked the target inside shm (libfabric 1.17; the pool-key test), and it would
    // put the target's worker on a pull's path. Writes with an immediate are commands anyway.
    // Bytes an operation of several runs may reach (runs join while the total stays within
    // it): no bound on shm; 16 KiB elsewhere. On tcp;ofi_rxm a write of 4 x 32 KiB runs took
    // longer than the four writes (KV 16,384 x 32 KiB: 200 against 158 ms, of 2 x 32 KiB 285
    // against 150; 4 x 4 KiB: 312 against 535 ms; bench_peers, 2-core VM, 2026-12-07), where
    // on shm joining won at both sizes (105 against 124 ms, 222 against 311). verbs and efa:
    // not measured (efa takes one iovec anyway).
    uint64_t join_bytes() const { return join_bytes_; }
    size_t max_iovs(FabricOp::Type type, bool has_imm) const {
        return (initiator_copies_single_rma_ && (type == FabricOp::kRead || !has_imm)) ? 1
                                                                                       : max_iovs_;
    }
    bool needs_local_desc() const { return (mr_mode_ & FI_MR_LOCAL) != 0; }
    fid_domain* domain() const { return domain_; }
    const RailStats& stats() const { return stats_; }
    // Largest write posted with FI_INJECT (0: none): the provider's tx_attr inject_size.
    size_t inject_size() const { return inject_size_; }
    // Whether the provider completes operations in post order (tx comp_order STRICT).
    bool completions_ordered() const { return comp_ordered_; }

    // True when the worker has been inside one provider call for longer than `limit`: the
    // provider is wedged (seen with shm when a peer is killed while holding a lock in shared
    // memory). Called by the engine's watchdog thread only.
    bool stuck_for(Duration limit, TimePoint now) { return calls_.inside_for(now) > limit; }
    // Worker thread: what a provider call marks with a CallGuard (EngineImpl's test wedge too).
    CallMonitor& call_monitor() { return calls_; }
    // CPU time the worker thread has used so far (none before start()): tells a worker spinning
    // inside the provider from one the scheduler left off the CPU on an overloaded host.
    std::optional<Duration> worker_cpu_time() const;
    // Marks the rail wedged: new work fails at once, and the worker, if its call ever returns,
    // exits without touching anything. The rail is then never freed (see stop()).
    void mark_wedged() { wedged_.store(true, std::memory_order_release); }
    bool wedged() const { return wedged_.load(std::memory_order_acquire); }

    // Hands a linked batch of ops to the worker.
    void submit(FabricOp* first, FabricOp* last);
    void submit(FabricOp* op) { submit(op, op); }
    // Runs fn on the worker thread and returns its result. Waits `timeout` for the worker to
    // take the task, and once more for a task it is running (a provider call that is merely
    // slow); then the caller gets kTimeout. fn and release run on the worker, maybe after the
    // caller returned: they must own what they touch (capture by value), and fn hands its
    // product back as its value, never through the caller's frame. A task not yet taken when
    // its caller gives up never runs; one that finishes after, the worker passes its value to
    // `release` (close the MR it opened, remove the address it inserted), so nothing it made is
    // left without an owner.
    template <class T>
    Result<T> run_on_worker(std::function<Result<T>()> fn, Duration timeout,
                            std::function<void(T&)> release = {}) {
        auto task = std::make_shared<WorkerTaskOf<T>>(std::move(fn), std::move(release));
        Status s = run_task(task, timeout);
        if (!s.ok()) return s;
        return task->take();
    }
    // A task that produces nothing but its status.
    Status run_on_worker(std::function<Status()> fn, Duration timeout);

    // Worker-thread only (call from run_on_worker). cuda_device >= 0: the memory is CUDA
    // memory on that device (FI_HMEM_CUDA; the domain must have been opened with FI_HMEM).
    Result<fid_mr*> register_mr(void* ptr, size_t len, uint64_t access, int cuda_device = -1);
    // Refuses an address that cannot be this provider's (empty, another length than this
    // rail's own, a string without its terminator) before libfabric reads past its end.
    Result<fi_addr_t> insert_address(const std::vector<uint8_t>& addr);
    // Worker-thread only: takes back what insert_address returned (a connect that failed on a
    // later rail must not leave the peer in this rail's address vector with no owner).
    Status remove_address(fi_addr_t fa);
    // Worker-thread only: before local memory is deregistered and handed back to its owner,
    // waits (completing and posting as usual) until libfabric has returned every operation
    // whose local buffer lies in [base, base + len), those that timed out and were already
    // reported failed included, or until `deadline`. Returns how many it still holds. A
    // software provider (tcp) copies a late read's data into the buffer whether or not it is
    // still registered: freed memory would be overwritten.
    size_t settle_local(const void* base, size_t len, TimePoint deadline);
    // Worker-thread only: calls then(still_held) on the worker once libfabric has returned
    // every operation whose local buffer overlaps one of `spans` (sorted by address, disjoint),
    // timed-out ones included, or at `deadline` with how many it still holds; at stop() with 0.
    void watch_release(std::vector<std::span<const uint8_t>> spans, TimePoint deadline,
                       std::function<void(size_t)> then);
    // Runs fn on the worker without waiting for it; done gets fn's status, or why it never
    // ran (the rail stopped first).
    OpRef post_task(std::function<Status()> fn, OpCallback done);

    // Signal region registration (done at open, before start).
    uint64_t signal_key() const { return signal_key_; }
    void* signal_base() const { return signal_buf_.get(); }

  private:
    Rail() = default;
    // run_on_worker's hand-off: ok once the task ran to the end (its result is in `task`).
    Status run_task(std::shared_ptr<WorkerTask> task, Duration timeout);
    Status init(int index, const fi_info* info, const EngineConfig& config);
    void run();
    // A caller expects arrivals and the later of its expectation's start and last_active is
    // within expect_spin of now.
    bool expecting_within_spin(TimePoint now, TimePoint last_active) const;
    bool drain_submissions();
    // Posts a popped operation at once when it can, or adds it to pending_. False when the
    // rail turned out wedged. `direct` counts the operations posted here.
    bool take_popped(FabricOp* op, size_t& direct);
    bool post_pending();
    // A post that failed (not pushed back): fails the operation's piece and frees it.
    void fail_post(FabricOp* op, int rc);
    // unsignaled: as fi_inject_write(data), which writes no completion (completes_at_post).
    int post_one(FabricOp* op, bool more, bool unsignaled);
    // The post of a write that goes without a completion (inline: take_popped calls it for
    // every 64 B write with immediate on shm).
    int post_unsignaled(FabricOp* op) {
        return static_cast<int>(
            op->has_imm
                ? fi_inject_writedata(tx_ep_, op->local, op->len, op->imm, op->dest, op->raddr,
                                      op->rkey)
                : fi_inject_write(tx_ep_, op->local, op->len, op->dest, op->raddr, op->rkey));
    }
    // A write the provider completes while posting it, so it goes without a completion and
    // finishes as soon as the post returns (see inject_done_at_post_).
    bool completes_at_post(const FabricOp* op) const {
        return inject_done_at_post_ && op->type == FabricOp::kWrite && op->has_imm &&
               op->len <= inject_size_ && op->more_iovs == 0;
    }
    bool poll_cq();
    void handle_completion(FabricCtx* ctx, uint64_t flags, size_t len, uint64_t data);
    void handle_error(const fi_cq_err_entry& err);
    void finish_op(FabricOp* op, const Status& s);
    // OpState::piece_done on the worker's hot paths: an operation this finishes waits in
    // finished_ops_ for retire_finished.
    void piece_done(FabricOp* op, const Status& s) {
        OpState* state = op->parent;
        if (state->last_piece_done(s)) {
            state->retired_next = finished_ops_;
            finished_ops_ = state;
        }
    }
    // Unregisters the operations finished since the last call, under one registry lock, and
    // lets go of their pieces' references. Once per worker pass, and at stop().
    void retire_finished();
    void sweep_timeouts(TimePoint now);
    // Reports an in-flight operation failed while libfabric still owns its context: the op
    // stays in abandoned_ until its completion comes back or the endpoint is closed.
    void abandon(FabricOp* op, const Status& why);
    // As abandon, but reports nothing: the operation's piece lives on in a copy (repost_copy).
    OpState* detach(FabricOp* op);
    void link_inflight(FabricOp* op) { inflight_.push_back(op); }
    void unlink_inflight(FabricOp* op) { inflight_.erase(op); }
    Status post_recv(int slot);
    std::string describe(const FabricOp* op) const;
    // shm recovery (see renew_on_stall_): a fresh initiator endpoint for new operations.
    Status renew_initiator();
    // An in-flight operation timed out: on a provider whose initiator completions queue
    // behind each other, decide whether the peer died and move on to a fresh endpoint.
    void on_inflight_timeout(const FabricOp* op);
    // shm: asks (at most every kDeadPeerProbeEvery) whether the peer of the oldest operation
    // of each initiator endpoint still exists once it has waited kDeadPeerProbeAfter, so that
    // a dead peer is found in a fraction of a second instead of at the op timeout.
    void probe_stalled_peers(TimePoint now);
    // The operations in flight on initiator endpoint `gen` wait behind a dead peer's entry in
    // its response queue and can never complete: reads to live peers are posted again (first,
    // on the current endpoint), the rest fail now instead of at their deadlines.
    void give_up_behind_dead_peer(uint32_t gen);
    Status dead_peer_error(const FabricOp* op) const;
    // Closes retired initiator endpoints that no operation in flight uses any more (each holds
    // a 16 MiB shm file, about 4 MiB of it touched: ls -s of /dev/shm, 2026-12-02).
    void close_idle_retired();
    bool peer_dead(fi_addr_t dest) const {
        return !dead_peers_.empty() && dead_peers_.count(dest) != 0;
    }
    void fail_dead_peer_op(FabricOp* op);
    // Operations libfabric still holds (in flight, or abandoned on an endpoint still open)
    // whose local buffer overlaps one of the sorted, disjoint spans.
    size_t held_in(std::span<const std::span<const uint8_t>> spans) const;
    void check_release_watches(TimePoint now);

    int index_ = 0;
    EngineConfig config_;
    RailHooks hooks_;
    fi_info* info_ = nullptr;
    fid_fabric* fabric_ = nullptr;
    fid_domain* domain_ = nullptr;
    fid_ep* ep_ = nullptr;  // the published endpoint: receives, and posts until renewed
    fid_av* av_ = nullptr;
    fid_cq* cq_ = nullptr;
    uint64_t mr_mode_ = 0;
    std::atomic<uint64_t> next_key_{1};
    std::vector<uint8_t> name_;
    size_t tx_depth_ = 0;
    size_t inject_size_ = 0;                    // writes of at most this many bytes carry FI_INJECT
    size_t max_iovs_ = 1;                       // see max_iovs()
    bool initiator_copies_single_rma_ = false;  // shm: see max_iovs(type, has_imm)
    uint64_t join_bytes_ = 16 << 10;            // see join_bytes()
    bool comp_ordered_ = false;                 // provider orders completions (FI_ORDER_STRICT)
    // shm writes the completion of a write with immediate of at most inject_size while
    // posting it (the inline and inject protocols of smr_generic_rma, libfabric 1.17): it
    // carries nothing the post's return code did not (a dead peer's write "completes" just
    // the same; its full command queue pushes back instead). Such writes are posted with
    // fi_inject_writedata, which writes no completion, and finish when the post returns: no CQ
    // entry to write and read, no in-flight list. Not writes without an immediate: shm may
    // copy those straight into the peer (process_vm_writev, "fast RMA"), and when that fails
    // (the peer died) it reports an error without the operation's context; with the
    // completion requested such a write at least times out and fails, and whether the inject
    // call reports that failure differs between shm versions. (The "completion error without
    // context" the batch-kill test logs with some seeds is that path, before this change too.)
    // EngineConfig::inject_completions turns it off.
    bool inject_done_at_post_ = false;

    // Signal region: target of immediate-only writes.
    std::shared_ptr<uint8_t[]> signal_buf_;  // shared by the engine's rails
    fid_mr* signal_mr_ = nullptr;
    uint64_t signal_key_ = 0;

    // Control messages: registered receive and send slots.
    size_t slot_size_ = 0;
    std::vector<uint8_t> recv_pool_;
    fid_mr* recv_mr_ = nullptr;
    std::vector<FabricCtx> recv_ctx_;
    std::vector<uint8_t> send_pool_;
    fid_mr* send_mr_ = nullptr;
    std::vector<int> free_send_slots_;

    MpscQueue queue_;
    OpList pending_;                   // popped from the queue, not yet posted
    OpList inflight_;                  // in flight, oldest first
    OpState* finished_ops_ = nullptr;  // finished, not yet retired (linked by retired_next)
    // Whether pending_ may hold operations to more than one peer (false: all go to
    // pending_peer_). When that peer pushes back, post_pending stops at once instead of walking
    // the rest of the list to look for other peers: under callgrind that walk was up to ~750
    // of the worker's instructions per 64 B write to one peer (shm, 2026-12-02).
    bool pending_mixed_ = false;
    PeerId pending_peer_ = 0;
    // No operation in pending_ has an earlier deadline (a lower bound: an operation posted
    // since may have had it). sweep_timeouts walks pending_ only once `now` passes it: a KV
    // transfer's 131,072 writes of 4 KiB sat in pending_ behind tcp's in-flight limit, and the
    // walk of all of them every tick (1 ms) took most of the worker's time, more the more
    // writes were posted at once (docs/BENCHMARKS.md, "ferry beside NIXL and Mooncake").
    TimePoint pending_min_deadline_ = TimePoint::max();
    // When each peer (by PeerId) last completed an operation of this rail, recorded while
    // operations wait in pending_: a read or write that waits behind its peer's earlier ones
    // (tx_depth_, or the provider pushing back) times out only once that peer has answered
    // nothing for op_timeout, not op_timeout after it was submitted. A pull of a few thousand
    // 64 B runs (vLLM's transposed K pages between block sizes) failed "could not be posted"
    // under load while its peer answered throughout, and each try posted every run again.
    std::vector<TimePoint> peer_answered_;
    void note_answered(PeerId peer) {
        if (peer >= peer_answered_.size()) peer_answered_.resize(peer + 1);
        peer_answered_[peer] = Clock::now();
    }
    // A pending read or write whose deadline passed while its peer answered within op_timeout:
    // its new deadline, or TimePoint{} when it has timed out.
    TimePoint pending_deadline_after_progress(const FabricOp* op, TimePoint now) const;
    void add_pending(FabricOp* op) {
        pending_min_deadline_ = std::min(pending_min_deadline_, op->deadline);
        if (pending_.empty()) {
            pending_peer_ = op->peer;
            pending_mixed_ = false;
        } else if (op->peer != pending_peer_) {
            pending_mixed_ = true;
        }
        pending_.push_back(op);
    }
    IdleWait idle_;
    // Operations reported finished (timed out, their peer dead, or replaced by a copy posted
    // again, see repost_copy) while libfabric may still hold their context. Ownership: the
    // worker's, through this set alone (no list links them, no OpState points to them: their
    // parent is cleared when they leave it). Freed by finish_op when their completion is read,
    // or by stop() after every endpoint is closed. One whose endpoint close_idle_retired
    // closed can no longer complete but stays here until stop(): a completion of it may
    // already sit in the shared CQ, and freeing it sooner would hand a freed context to the
    // next poll_cq. Bounded: at most the endpoint's in-flight operations (tx_depth_) per dead
    // peer found, about 256 bytes each.
    std::unordered_set<FabricOp*> abandoned_;
    struct ReleaseWatch {
        std::vector<std::span<const uint8_t>> spans;
        TimePoint deadline;
        std::function<void(size_t)> then;
    };
    std::vector<ReleaseWatch> release_watches_;  // see watch_release

    // Initiator endpoints. shm completes every operation that needs an answer from its target
    // (writes with immediates above inject_size, 4 KiB, among them: what KV transfers post)
    // through one response queue per endpoint in the initiator's own region, drained strictly in
    // order: an entry owed by a peer that died stays busy forever and holds every later completion
    // of that endpoint, to any peer. The cure is a fresh endpoint (a fresh queue) on the same
    // domain, AV and CQ for new operations; ep_ stays open and keeps receiving, so the published
    // address stays valid (a target's work never touches its own response queue).
    struct FidEpCloser {
        void operator()(fid_ep* ep) const;
    };
    using EpPtr = std::unique_ptr<fid_ep, FidEpCloser>;
    struct RetiredEp {
        EpPtr ep;
        uint32_t gen;
    };
    bool renew_on_stall_ = false;  // shm, and registrations are not bound to an endpoint
    fid_ep* tx_ep_ = nullptr;      // where operations are posted: ep_ or fresh_tx_
    uint32_t tx_gen_ = 0;          // bumped with every fresh initiator endpoint
    // Ownership: the worker's (closed by stop() after the worker is joined). fresh_tx_ is the
    // current one; renew_initiator moves it to retired_, and close_idle_retired closes a
    // retired one once no operation in inflight_ was posted on it (what was given up on it is
    // in abandoned_, see there). Only the worker posts, polls and closes, so an endpoint is
    // never closed under a call into it.
    EpPtr fresh_tx_;
    std::vector<RetiredEp> retired_;
    // shm: peers' process ids, from their region names (same host), to tell a peer that died
    // from one that is only slow; and the peers known dead, whose operations fail at once
    // instead of poisoning the fresh endpoint's queue.
    std::unordered_map<fi_addr_t, long> peer_pid_;
    std::unordered_set<fi_addr_t> dead_peers_;
    TimePoint next_probe_{};  // probe_stalled_peers reads /proc no sooner than this

    std::thread worker_;
    clockid_t cpu_clock_{};  // the worker's CPU-time clock, set by start()
    bool has_cpu_clock_ = false;
    std::atomic<bool> running_{false};
    std::atomic<bool> wedged_{false};
    CallMonitor calls_;
    std::atomic<bool> sleeping_{false};
    std::mutex nap_mu_;
    std::condition_variable nap_cv_;
    bool wake_ = false;
    RailStats stats_;
};

}  // namespace ferry::detail
