// The rails of one engine, and the policy that spreads an operation over them: how long writes
// are split into pieces, which rail each piece goes to, and handing each rail its pieces.
// Between the engine (requests, validation) and the rail (one domain, one worker thread).
#pragma once

#include <rdma/fabric.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "fabric/rail.h"
#include "fabric/rail_placement.h"
#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"

namespace ferry::detail {

// How long an engine task on a rail worker (registration, address insertion) may take.
inline constexpr Duration kRailTaskTimeout = std::chrono::seconds(10);

// The fabric operations of one user operation, a chain per rail, handed to the rails together
// once the piece count is final (the OpState must know it before any piece can complete).
struct RailBatch {
    // Chains live inline for up to kInline rails: two std::vectors per operation were two of
    // the five heap allocations of a 64 B write (2026-12-01).
    static constexpr size_t kInline = 8;
    explicit RailBatch(size_t rails) : n_(rails) {
        if (rails > kInline) {
            heap_.assign(2 * rails, nullptr);
            first_ = heap_.data();
            last_ = heap_.data() + rails;
        } else {
            first_ = inline_first_;
            last_ = inline_last_;
        }
    }
    RailBatch(const RailBatch&) = delete;
    RailBatch& operator=(const RailBatch&) = delete;

    size_t rails() const { return n_; }
    FabricOp* first(size_t r) const { return first_[r]; }
    FabricOp* last(size_t r) const { return last_[r]; }
    uint32_t count = 0;
    void add(int rail, FabricOp* op) {
        if (!first_[rail])
            first_[rail] = op;
        else
            last_[rail]->mpsc_next.store(op, std::memory_order_relaxed);
        last_[rail] = op;
        ++count;
    }
    // Calls fn(op) for every op of rail r's chain, in post order.
    template <typename Fn>
    void for_each(size_t r, Fn&& fn) const {
        for (FabricOp* op = first_[r]; op;) {
            // Read the link before fn: fn may free the op.
            FabricOp* next =
                op == last_[r]
                    ? nullptr
                    : static_cast<FabricOp*>(op->mpsc_next.load(std::memory_order_relaxed));
            fn(op);
            op = next;
        }
    }

  private:
    size_t n_;
    FabricOp* inline_first_[kInline] = {};
    FabricOp* inline_last_[kInline] = {};
    std::vector<FabricOp*> heap_;
    FabricOp** first_;
    FabricOp** last_;
};

class RailGroup {
  public:
    // Opens one rail per candidate round robin until config.num_rails are open. hooks_for(r)
    // gives rail r's hooks. On failure the rails opened so far stay for stop().
    Status open(std::span<const fi_info* const> candidates, const EngineConfig& config,
                const std::function<RailHooks(int rail)>& hooks_for);
    void start();
    // Fails everything outstanding on every rail with `why` and joins the workers.
    void stop(const Status& why);
    // Frees the rails; a wedged rail's worker may still be inside the provider, so its objects
    // are left behind instead.
    void release();

    size_t size() const { return rails_.size(); }
    bool empty() const { return rails_.empty(); }
    Rail& operator[](size_t r) const { return *rails_[r]; }
    auto begin() const { return rails_.begin(); }
    auto end() const { return rails_.end(); }

    // Every rail of the group.
    RailSet all() const { return all_; }

    // The rail for an operation that goes to one rail of `use` (a non-empty subset of all()):
    // successive operations rotate over those rails, so concurrent small operations still use
    // every NIC the memory is near.
    int next_rail(RailSet use) {
        // One rail: no shared counter to bump (an atomic add per operation on the submitter).
        if (rails_.size() == 1) return 0;
        const uint32_t k = rr_.fetch_add(1, std::memory_order_relaxed);
        if (use == all_) return static_cast<int>(k % rails_.size());
        return nth_rail(use, k % static_cast<uint32_t>(__builtin_popcountll(use)));
    }
    int next_rail() { return next_rail(all_); }

    // Splits `len` bytes into the pieces one operation posts on the rails of `use` and picks
    // each piece's rail: piece(rail, offset, length) is called in post order, at least once (a
    // 0-byte write with an immediate is one piece).
    //
    // Every piece is at most max_write_size. With `stripe`, a transfer above stripe_threshold
    // on more than one rail becomes one piece per rail (4 KiB aligned, so KV pages stay
    // whole), each rail's NIC moving its share at once; below the threshold a second rail
    // would only add a post and a completion to wait for, so the transfer stays on one rail and
    // operations rotate over rails instead (next_rail). Paged writes pass stripe = false:
    // their page runs are already many operations, rotated the same way. The 1 MiB default
    // threshold has not been measured on multi-NIC hardware; see EngineConfig.
    // Whether split makes one piece of `len` bytes (every small transfer): callers may then
    // build it on next_rail(use) themselves.
    uint64_t max_write_size() const { return max_write_size_; }
    bool one_piece(uint64_t len, bool stripe, RailSet use) const {
        return len <= max_write_size_ &&
               (!stripe || len <= stripe_threshold_ || (use & (use - 1)) == 0);
    }

    template <typename PieceFn>
    void split(uint64_t len, bool stripe, RailSet use, PieceFn&& piece) {
        if (one_piece(len, stripe, use)) {
            piece(next_rail(use), 0, len);
            return;
        }
        const int nr = __builtin_popcountll(use);
        uint64_t chunk = max_write_size_;
        if (stripe && nr > 1 && len > stripe_threshold_) {
            uint64_t per = (len + nr - 1) / nr;
            per = (per + 4095) & ~uint64_t{4095};
            chunk = std::min<uint64_t>(chunk, per);
        }
        int rail = next_rail(use);
        uint64_t done = 0;
        do {
            uint64_t n = std::min<uint64_t>(chunk, len - done);
            piece(rail, done, n);
            done += n;
            rail = after(use, rail);
        } while (done < len);
    }

    // Hands every rail its chain of the batch, rail 0 first.
    void post(const RailBatch& b);
    // Frees a batch that will not be posted.
    static void discard(const RailBatch& b);

    // Ends every rail's nap (the engine's stay-awake condition changed).
    void wake_all();
    // Counters summed over the rails.
    EngineStats stats() const;
    // Each rail's counters, in rail order.
    std::vector<EngineStats> rail_stats() const;

  private:
    // The k-th rail of `use` (k < its size), lowest first.
    static int nth_rail(RailSet use, uint32_t k) {
        for (; k > 0; --k) use &= use - 1;
        return __builtin_ctzll(use);
    }
    // The rail of `use` after `rail`, wrapping round.
    static int after(RailSet use, int rail) {
        RailSet later = rail >= 63 ? 0 : use & (~RailSet{0} << (rail + 1));
        return __builtin_ctzll(later ? later : use);
    }

    std::vector<std::unique_ptr<Rail>> rails_;
    std::atomic<uint32_t> rr_{0};
    RailSet all_ = 0;
    uint64_t stripe_threshold_ = 0;
    uint64_t max_write_size_ = 0;
};

}  // namespace ferry::detail
