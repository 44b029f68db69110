// Shared state of one user-visible operation, which may be split into many fabric
// operations across rails. The last piece to finish runs the callback, then wakes waiters.
// It can also be failed from outside (a wedged rail): finishing happens exactly once.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <utility>

#include "fabric/op_pool.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"

namespace ferry::detail {

struct OpState;

// The status handed to every callback of an operation that succeeded.
// constinit: initialised at compile time, before any static constructor could use it.
inline constinit const Status kOkStatus{};

// Where threads sleep on operations, and what guards an operation's error status: a fixed set
// of mutex and condition-variable pairs that all operations share (each state uses the pair its
// address picks), instead of a pair in every OpState. Both are needed only when a piece fails
// or a thread waits on a handle; in every state they cost a condition variable's construction
// and destruction (~25 instructions per 64 B write on the submitter and the worker, callgrind,
// 2026-12-02) and 88 of its bytes, a cache line more to carry between the two threads' cores.
// A notify_all may wake waiters on other operations of the same pair: they check their own
// operation and sleep again.
struct WaitSlot {
    std::mutex mu;
    std::condition_variable cv;
};
inline WaitSlot& wait_slot(const OpState* s) {
    constexpr size_t kSlots = 64;
    static WaitSlot slots[kSlots];
    return slots[(reinterpret_cast<uintptr_t>(s) / 64) % kSlots];
}

// Operations handed to rails and not finished yet, so a watchdog can fail those stuck on a
// wedged rail. An intrusive list: insert and erase allocate nothing (an unordered_set node
// per operation was one of the five heap allocations of a 64 B write, 2026-12-01).
struct OpRegistry {
    std::mutex mu;
    OpState* head = nullptr;
    // Both under mu.
    void insert(OpState* s);
    void erase(OpState* s);
    template <typename Fn>
    void for_each(Fn&& fn);
};

// What submit_batch's entries share: the caller's callback, and how many entries are still to
// finish (the last one frees it).
struct BatchDone {
    BatchDone(BatchCallback&& c, size_t n) : cb(std::move(c)), left(n) {}
    // Made by the submitting thread and freed by a rail's worker, like an OpState: through
    // OpPool, not malloc, whose free on the worker took the submitting thread's arena (~8
    // instructions per 64 B write of 32-entry batches on both threads, callgrind, shm,
    // 2026-12-03, and the arena's lines moving between their cores).
    static void* operator new(size_t) { return OpPool<sizeof(BatchDone), 64>::allocate(); }
    static void operator delete(void* p) { OpPool<sizeof(BatchDone), 64>::release(p); }

    BatchCallback cb;
    std::atomic<size_t> left;
    void entry_done(size_t index, const Status& s) {
        cb(index, s);
        if (left.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
    }
};

// References: an OpState counts them itself (OpRef, OpHandle), and the pieces of an operation
// (its FabricOps, a GPU copy's callback) hold one between them, taken by set_pieces and let go
// by the last piece_done, instead of a shared_ptr per piece. A 64 B write through submit_batch
// went through seven atomic read-modify-writes on shared_ptr counts (the enable_shared_from_this
// weak count, the handle's copy, the piece's copy and the drops of each), a good part of them on
// the worker; now two: the pieces' release on the worker and the handle's.
struct OpState {
    // The callback is taken by reference to an rvalue down from make_op_state: one move of a
    // std::function per operation instead of three (~20 instructions per submit_batch entry).
    explicit OpState(OpCallback&& cb) : callback(std::move(cb)) {}
    // An entry of submit_batch: finishing calls batch->entry_done(index) directly. A per-entry
    // OpCallback wrapping it cost its construction and move on the submitting thread and one
    // more call through std::function on the worker (~40 instructions per 64 B write,
    // callgrind, shm, 2026-12-02).
    OpState(BatchDone* batch, size_t index) : batch(batch), batch_index(index) {}
    OpState(const OpState&) = delete;
    OpState& operator=(const OpState&) = delete;

    // Recycled through OpPool: made by the submitting thread, most freed by a rail's worker.
    static void* operator new(size_t) { return OpPool<sizeof(OpState), 64>::allocate(); }
    static void operator delete(void* p) { OpPool<sizeof(OpState), 64>::release(p); }

    void add_ref() { refs.fetch_add(1, std::memory_order_relaxed); }
    void release() {
        if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
    }
    // A reference unless the last one is being let go right now (the watchdog's registry walk).
    bool try_add_ref() {
        uint32_t n = refs.load(std::memory_order_relaxed);
        while (n != 0) {
            if (refs.compare_exchange_weak(n, n + 1, std::memory_order_relaxed)) return true;
        }
        return false;
    }

    // Must be called with the final piece count before any piece is handed to a worker: from
    // then on the pieces hold a reference until the last of them is done.
    void set_pieces(uint32_t n) {
        remaining.store(n, std::memory_order_relaxed);
        if (n) add_ref();
    }

    void piece_done(const Status& s) {
        if (!s.ok()) record(s);
        if (count_down()) {
            finish();
            release();  // the pieces' reference
        }
    }

    // piece_done for a rail's worker, which finishes many operations per pass: the last piece
    // finishes the operation but leaves its registry entry and the pieces' reference to the
    // caller, which lets go of a pass's worth at once (Rail::retire_finished, one registry
    // lock per pass). Returns whether this was the last piece. The registry's lock and unlock
    // were ~60 of the worker's instructions per 64 B write (callgrind, shm, 2026-12-02).
    bool last_piece_done(const Status& s) {
        if (!s.ok()) record(s);
        if (!count_down()) return false;
        finish(/*unregister=*/false);
        return true;
    }

    // Completes an operation that never reached the wire, or one given up on. An operation
    // already finished keeps its status (the watchdog may still find one in the registry).
    void fail_now(Status s) {
        if (finished.load(std::memory_order_acquire)) return;
        record(std::move(s));
        finish();
    }

    // The worker finishes most operations while the submitting thread makes the next ones, so
    // finish() touches what it must and no more: the status under the lock only when a piece
    // failed, and the condition variable only when a thread waits on the handle. (It took the
    // mutex twice and notified every time; with the registry's lock that was four lock/unlock
    // pairs per operation on the worker. Not measured on its own: it went in with OpPool and
    // the worker's prefetch, measured together in docs/BENCHMARKS.md, 2026-12-02.)
    void finish(bool unregister = true) {
        if (finished.exchange(true, std::memory_order_acq_rel)) return;
        if (registry && unregister) {
            std::lock_guard lk(registry->mu);
            registry->erase(this);
        }
        // The error, once set, is never replaced (record): after failed is seen it is read
        // without the lock. Success passes the one shared ok status: no Status built and
        // destroyed per operation on the worker.
        const Status& final_status = failed.load(std::memory_order_acquire) ? *status : kOkStatus;
        if (batch)
            batch->entry_done(batch_index, final_status);
        else if (callback)
            callback(final_status);
        // seq_cst store, then load: pairs with OpHandle::wait's increment, then load, so that
        // either the waiter sees done or this sees the waiter.
        done.store(true);
        if (waiters.load() > 0) {
            WaitSlot& w = wait_slot(this);
            { std::lock_guard lk(w.mu); }
            w.cv.notify_all();
        }
    }

    std::atomic<uint32_t> refs{1};  // the creator's (see OpRef::make)
    std::atomic<uint32_t> remaining{0};
    std::atomic<bool> finished{false};
    std::atomic<bool> failed{false};  // status holds an error
    uint32_t imm_writes = 0;
    uint64_t rail_mask = 0;  // rails holding pieces of this operation
    // The engine's; it outlives every operation it registered (shutdown fails them all first).
    // Not a shared_ptr: the count on one shared control block went up on the submitting thread
    // and down on the worker for every operation.
    OpRegistry* registry = nullptr;
    OpState* reg_prev = nullptr;  // registry list, under registry->mu
    OpState* reg_next = nullptr;
    bool in_registry = false;
    OpState* retired_next = nullptr;  // a rail worker's list of finished states (Rail)
    OpCallback callback;
    BatchDone* batch = nullptr;  // instead of callback, for an entry of submit_batch
    size_t batch_index = 0;
    // Atomic so that OpHandle::done() and a spinning wait read it without the lock.
    std::atomic<bool> done{false};
    std::atomic<uint32_t> waiters{0};  // threads asleep (or going to sleep) in OpHandle::wait
    // The first error, under wait_slot(this).mu; none while every piece succeeds. A pointer,
    // not a Status in place: a Status (its std::string) is 40 bytes, and building it wrote a
    // third cache line of every operation for the worker to fetch; the state is now two
    // lines (docs/BENCHMARKS.md, issue 18, third round).
    std::unique_ptr<Status> status;
    // The final status (after done).
    Status result() const { return status ? *status : ok_status(); }

  private:
    // Counts one piece done; true for the last. Only pieces count down, so a piece that reads
    // 1 is the last and alone: it skips the locked read-modify-write, as every operation of one
    // piece (every small write) does. The acquire pairs with the other pieces' count-down (and
    // what record() wrote before it).
    bool count_down() {
        if (remaining.load(std::memory_order_acquire) == 1) {
            remaining.store(0, std::memory_order_relaxed);
            return true;
        }
        return remaining.fetch_sub(1, std::memory_order_acq_rel) == 1;
    }
    void record(Status s) {
        std::lock_guard lk(wait_slot(this).mu);
        if (!status) status = std::make_unique<Status>(std::move(s));
        failed.store(true, std::memory_order_release);
    }
};

// An owning reference to an OpState.
class OpRef {
  public:
    OpRef() = default;
    static OpRef make(OpCallback&& cb) { return OpRef(new OpState(std::move(cb))); }
    static OpRef make(BatchDone* batch, size_t index) { return OpRef(new OpState(batch, index)); }
    // Takes over a reference already counted (OpState::try_add_ref).
    static OpRef adopt(OpState* s) { return OpRef(s); }
    // A new reference to a state some other reference keeps alive.
    static OpRef share(OpState* s) {
        s->add_ref();
        return OpRef(s);
    }
    OpRef(const OpRef& o) : s_(o.s_) {
        if (s_) s_->add_ref();
    }
    OpRef(OpRef&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
    OpRef& operator=(OpRef o) noexcept {
        std::swap(s_, o.s_);
        return *this;
    }
    ~OpRef() {
        if (s_) s_->release();
    }
    OpState* get() const { return s_; }
    OpState* operator->() const { return s_; }
    OpState& operator*() const { return *s_; }
    explicit operator bool() const { return s_ != nullptr; }
    // Gives the reference up to the caller (OpHandle).
    OpState* release_ref() { return std::exchange(s_, nullptr); }

  private:
    explicit OpRef(OpState* s) : s_(s) {}
    OpState* s_ = nullptr;
};

inline OpRef make_op_state(OpCallback&& cb) { return OpRef::make(std::move(cb)); }

template <typename Fn>
void OpRegistry::for_each(Fn&& fn) {
    for (OpState* s = head; s;) {
        OpState* next = s->reg_next;
        fn(s);
        s = next;
    }
}

inline void OpRegistry::insert(OpState* s) {
    s->reg_prev = nullptr;
    s->reg_next = head;
    if (head) head->reg_prev = s;
    head = s;
    s->in_registry = true;
}

inline void OpRegistry::erase(OpState* s) {
    if (!s->in_registry) return;
    if (s->reg_prev)
        s->reg_prev->reg_next = s->reg_next;
    else
        head = s->reg_next;
    if (s->reg_next) s->reg_next->reg_prev = s->reg_prev;
    s->reg_prev = s->reg_next = nullptr;
    s->in_registry = false;
}

}  // namespace ferry::detail
