// Public face of the TransferEngine; the work is in EngineImpl and Rail.
#include "ferry/fabric/engine.h"

#include <fmt/format.h>

#include <algorithm>

#include "fabric/engine_impl.h"
#include "fabric/provider.h"
#include "ferry/common/spin.h"

namespace ferry {

Result<std::string> resolve_provider(const EngineConfig& config) {
    return detail::resolve_provider_name(config);
}

OpHandle::OpHandle(detail::OpRef state) : state_(state.release_ref()) {}
OpHandle::OpHandle(const OpHandle& o) : state_(o.state_) {
    if (state_) state_->add_ref();
}
OpHandle& OpHandle::operator=(const OpHandle& o) {
    OpHandle copy(o);
    std::swap(state_, copy.state_);
    return *this;
}
OpHandle::~OpHandle() {
    if (state_) state_->release();
}

bool OpHandle::done() const { return state_ && state_->done.load(std::memory_order_acquire); }

Status OpHandle::wait(Duration timeout, Duration spin) const {
    if (!state_) return invalid_argument("waiting on an empty OpHandle");
    detail::OpState& st = *state_;
    TimePoint deadline = deadline_after(timeout);
    spin_until([&] { return st.done.load(std::memory_order_acquire); }, std::min(spin, timeout));
    if (!st.done.load(std::memory_order_acquire)) {
        detail::WaitSlot& slot = detail::wait_slot(&st);
        std::unique_lock lk(slot.mu);
        // Counted before done is read again (both seq_cst): OpState::finish then notifies.
        st.waiters.fetch_add(1);
        bool finished = slot.cv.wait_until(lk, deadline, [&] { return st.done.load(); });
        st.waiters.fetch_sub(1);
        if (!finished) {
            return timeout_error(
                fmt::format("operation still running after {:.0f} ms", to_ms(timeout)));
        }
    }
    return st.result();
}

uint32_t OpHandle::imm_writes() const { return state_ ? state_->imm_writes : 0; }

MemoryRegion::~MemoryRegion() {
    if (engine_) engine_->deregister(id_, desc_);
}

Result<std::unique_ptr<TransferEngine>> TransferEngine::create(const EngineConfig& config) {
    auto impl = std::make_shared<detail::EngineImpl>();
    Status s = impl->init(config);
    if (!s.ok()) {
        impl->shutdown();
        return s.with_context("creating the transfer engine");
    }
    return std::unique_ptr<TransferEngine>(new TransferEngine(std::move(impl)));
}

TransferEngine::TransferEngine(std::shared_ptr<detail::EngineImpl> impl) : impl_(std::move(impl)) {}

TransferEngine::~TransferEngine() { impl_->shutdown(); }
void TransferEngine::shutdown() { impl_->shutdown(); }

const EngineAddress& TransferEngine::address() const { return impl_->address; }
uint64_t TransferEngine::engine_id() const { return impl_->address.engine_id; }
const std::string& TransferEngine::provider() const { return impl_->provider; }
int TransferEngine::num_rails() const { return static_cast<int>(impl_->address.rail_addrs.size()); }
const EngineConfig& TransferEngine::config() const { return impl_->config; }
bool TransferEngine::supports_gpu_memory() const { return impl_->fabric_gpu(); }
const std::string& TransferEngine::gpu_memory_note() const { return impl_->fabric_gpu_note(); }

Result<std::unique_ptr<MemoryRegion>> TransferEngine::register_memory(void* ptr, size_t len,
                                                                      MemoryKind kind, int device,
                                                                      RemoteAccess access) {
    return impl_->register_memory(ptr, len, kind, device, access);
}
Result<std::vector<std::unique_ptr<MemoryRegion>>> TransferEngine::register_memory(
    std::span<const std::span<uint8_t>> ranges, MemoryKind kind, int device, RemoteAccess access) {
    return impl_->register_memory(ranges, kind, device, access);
}
Result<PeerId> TransferEngine::connect(const EngineAddress& peer) { return impl_->connect(peer); }
std::optional<PeerId> TransferEngine::find_peer(uint64_t engine_id) const {
    return impl_->find_peer(engine_id);
}
Result<GroupId> TransferEngine::create_group(std::span<const PeerId> peers,
                                             std::span<const MemoryDescriptor> dsts) {
    return impl_->create_group(peers, dsts);
}
OpHandle TransferEngine::write(const WriteOp& op, OpCallback done) {
    return impl_->write(op, std::move(done));
}
OpHandle TransferEngine::paged_write(const PagedWriteOp& op, OpCallback done) {
    return impl_->paged_write(op, std::move(done));
}
size_t TransferEngine::inject_size() const {
    return impl_->rails.empty() ? 0 : impl_->rails[0].inject_size();
}
size_t TransferEngine::rma_iovs() const {
    return impl_->rails.empty() ? 1 : impl_->rails[0].max_iovs();
}
void TransferEngine::when_released(std::vector<std::span<const uint8_t>> spans, Duration timeout,
                                   std::function<void(size_t)> then) {
    impl_->when_released(std::move(spans), timeout, std::move(then));
}
std::vector<OpHandle> TransferEngine::submit_batch(std::span<const BatchEntry> ops,
                                                   BatchCallback done) {
    return impl_->submit_batch(ops, std::move(done));
}
OpHandle TransferEngine::submit_all(std::span<const BatchEntry> ops, OpCallback done) {
    return impl_->submit_all(ops, std::move(done));
}
OpHandle TransferEngine::write_runs(const WriteRunsOp& op, OpCallback done) {
    return impl_->write_runs(op, std::move(done));
}
OpHandle TransferEngine::read_runs(const ReadRunsOp& op, OpCallback done) {
    return impl_->read_runs(op, std::move(done));
}
OpHandle TransferEngine::copy_blocks(const BlockCopyOp& op, OpCallback done) {
    return impl_->copy_blocks(op, std::move(done));
}
bool TransferEngine::copies_on_gpu(PeerId peer, const MemoryRegion& local,
                                   const MemoryDescriptor& remote) const {
    return impl_->copies_on_gpu(peer, local, remote);
}
OpHandle TransferEngine::read(const ReadOp& op, OpCallback done) {
    return impl_->read(op, std::move(done));
}
OpHandle TransferEngine::scatter(const ScatterOp& op, OpCallback done) {
    return impl_->scatter(op, std::move(done));
}
Status TransferEngine::barrier(GroupId group, uint32_t imm, Duration timeout) {
    return impl_->barrier(group, imm, timeout);
}
OpHandle TransferEngine::signal(PeerId peer, uint32_t imm, OpCallback done) {
    return impl_->signal(peer, imm, std::move(done));
}
Status TransferEngine::wait_imm(uint32_t imm, uint64_t count, Duration timeout, Duration spin) {
    return impl_->imm.wait(imm, count, timeout, spin);
}
void TransferEngine::on_imm(uint32_t imm, uint64_t count, Duration timeout, OpCallback done) {
    impl_->imm.add_waiter(imm, count, deadline_after(timeout), std::move(done));
}
bool TransferEngine::try_take_imm(uint32_t imm, uint64_t count) {
    return impl_->imm.try_take(imm, count);
}
uint64_t TransferEngine::imm_available(uint32_t imm) const { return impl_->imm.available(imm); }
void TransferEngine::expect_arrivals(bool on, Expected what) { impl_->expect_arrivals(on, what); }
OpHandle TransferEngine::send_message(PeerId peer, std::span<const uint8_t> payload,
                                      OpCallback done) {
    return impl_->send_message(peer, payload, std::move(done));
}
void TransferEngine::set_message_handler(MessageHandler handler) {
    impl_->set_message_handler(std::move(handler));
}
EngineStats TransferEngine::stats() const { return impl_->stats(); }
Status TransferEngine::health() const { return impl_->health(); }

Status detail::wedge_rail_for_test(TransferEngine& engine, int rail, Duration limit) {
    return engine.impl_->wedge_rail_for_test(rail, limit);
}
std::vector<EngineStats> TransferEngine::rail_stats() const { return impl_->rail_stats(); }

bool never_posted(const Status& s) {
    return s.code() == StatusCode::kTimeout &&
           s.message().find(detail::kNeverPostedText) != std::string::npos;
}

}  // namespace ferry
