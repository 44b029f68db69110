// Batches: submit_batch (many operations, one handle and one completion each, handed to the
// rails together) and submit_all (many writes and reads as one operation, one completion).
#include <fmt/format.h>

#include <atomic>
#include <span>
#include <utility>

#include "fabric/engine_impl.h"

namespace ferry::detail {

std::vector<OpHandle> EngineImpl::submit_batch(std::span<const BatchEntry> ops,
                                               BatchCallback done) {
    std::vector<OpHandle> handles;
    handles.reserve(ops.size());
    if (ops.empty()) return handles;
    BatchDone* shared = done ? new BatchDone(std::move(done), ops.size()) : nullptr;
    RailBatch b(rails.size());
    // The states to arm and their piece counts. Armed only once the engine is known to be
    // running, so that a batch refused at shutdown leaves no piece reference behind. Raw
    // pointers: the handles hold the states.
    struct Built {
        OpState* state;
        uint32_t pieces;
        bool imm;
    };
    // On the stack up to kInlineBuilt entries: the vector's allocation and free were ~200 of
    // the submitting thread's ~1100 instructions per call of one 64 B write with immediate
    // (callgrind, shm, 2026-12-03).
    constexpr size_t kInlineBuilt = 32;
    Built inline_built[kInlineBuilt];
    std::vector<Built> heap_built;
    Built* built = inline_built;
    if (ops.size() > kInlineBuilt) {
        heap_built.resize(ops.size());
        built = heap_built.data();
    }
    size_t nbuilt = 0;
    // One deadline for the batch, not a clock read per entry (not measured on its own; it
    // went in with the changes measured in docs/BENCHMARKS.md, issue 18, 2026-12-02).
    const TimePoint deadline = deadline_after(config.op_timeout);
    for (size_t i = 0; i < ops.size(); ++i) {
        // One BatchDone for the batch (one allocation, not one per entry); each state points
        // at it with its index.
        OpRef state = shared ? OpRef::make(shared, i) : make_op_state(OpCallback{});
        OpState* st = state.get();
        // The handle takes the creator's reference: no count changes hands here.
        handles.emplace_back(std::move(state));
        uint32_t before = b.count;
        bool ok;
        bool imm = false;
        if (const auto* w = std::get_if<WriteOp>(&ops[i])) {
            ok = build_write(*w, st, b, deadline, true);
            imm = w->imm.has_value();
        } else {
            ok = build_read(std::get<ReadOp>(ops[i]), st, b, deadline, true);
        }
        if (ok) built[nbuilt++] = {st, b.count - before, imm};
    }
    if (stopped_) {
        RailGroup::discard(b);
        for (const Built& e : std::span(built, nbuilt))
            e.state->fail_now(cancelled("the transfer engine was shut down"));
        return handles;
    }
    for (const Built& e : std::span(built, nbuilt)) arm(e.state, e.pieces, e.imm);
    {
        std::lock_guard lk(registry_->mu);
        for (const Built& e : std::span(built, nbuilt)) registry_->insert(e.state);
    }
    rails.post(b);
    return handles;
}

// One OpState for the whole batch: each entry costs a FabricOp and its post, nothing else
// (submit_batch's per-entry state, callback, handle and registry entry were ~375 instructions
// of the worker's ~1460 per 64 B write, callgrind, 2026-12-02). 64 B writes with immediates
// to one peer, 32 per call, 16-core host, shm: 1.01x of the raw fi_writedata loop this way,
// 0.77x through submit_batch; to 64 peers 0.80x against 0.48x (docs/BENCHMARKS.md,
// 2026-12-02). Entries are validated and built in order into one RailBatch; the first that
// fails validation fails the operation, and the ones built before it are freed unposted.
OpHandle EngineImpl::submit_all(std::span<const BatchEntry> ops, OpCallback done) {
    auto state = make_op_state(std::move(done));
    if (ops.empty()) {
        state->fail_now(invalid_argument("submit_all: no operations given"));
        return OpHandle(std::move(state));
    }
    RailBatch b(rails.size());
    const TimePoint deadline = deadline_after(config.op_timeout);
    uint32_t imm_writes = 0;
    for (const BatchEntry& e : ops) {
        uint32_t before = b.count;
        bool built;
        const auto* w = std::get_if<WriteOp>(&e);
        if (w) {
            built = build_write(*w, state.get(), b, deadline, false);
        } else {
            built = build_read(std::get<ReadOp>(e), state.get(), b, deadline, false);
        }
        if (!built) {  // failed validation: the state is finished with its error
            RailGroup::discard(b);
            return OpHandle(std::move(state));
        }
        if (w && w->imm) imm_writes += b.count - before;
    }
    state->imm_writes = imm_writes;
    return submit(b, std::move(state), false);
}

}  // namespace ferry::detail
