#include "fabric/control.h"

#include <fmt/format.h>

#include <cstring>

#include "ferry/common/log.h"

namespace ferry::detail {
namespace {

constexpr uint32_t kMessageMagic = 0x46524d53;  // "FRMS"
constexpr size_t kMessageHeader = sizeof(uint32_t) + sizeof(uint64_t);

}  // namespace

Status ControlChannel::check_size(size_t payload_size) const {
    if (payload_size > config_.max_message_size) {
        return invalid_argument(fmt::format("message of {} bytes exceeds max_message_size {}",
                                            payload_size, config_.max_message_size));
    }
    return ok_status();
}

FabricOp* ControlChannel::make_send(uint64_t sender, PeerId peer, fi_addr_t dest,
                                    std::span<const uint8_t> payload, TimePoint deadline) const {
    auto* op = new FabricOp();
    op->type = FabricOp::kSend;
    op->peer = peer;
    op->dest = dest;
    op->extra = std::make_unique<FabricOpExtra>();
    std::vector<uint8_t>& bytes = op->extra->payload;
    bytes.resize(kMessageHeader + payload.size());
    std::memcpy(bytes.data(), &kMessageMagic, 4);
    std::memcpy(bytes.data() + 4, &sender, 8);
    if (!payload.empty())
        std::memcpy(bytes.data() + kMessageHeader, payload.data(), payload.size());
    op->deadline = deadline;
    return op;
}

void ControlChannel::deliver(std::span<const uint8_t> wire) {
    uint32_t magic = 0;
    if (wire.size() < kMessageHeader ||
        (std::memcpy(&magic, wire.data(), 4), magic != kMessageMagic)) {
        dropped_.fetch_add(1, std::memory_order_relaxed);
        log(LogLevel::kWarn, "fabric", "dropped a malformed control message of {} bytes",
            wire.size());
        return;
    }
    uint64_t sender = 0;
    std::memcpy(&sender, wire.data() + 4, 8);
    auto payload = wire.subspan(kMessageHeader);
    std::lock_guard lk(mu_);
    if (handler_) return call(sender, payload);
    if (held_.size() >= static_cast<size_t>(config_.message_recv_buffers) * 16) {
        dropped_.fetch_add(1, std::memory_order_relaxed);
        log(LogLevel::kWarn, "fabric", "no message handler set: dropped a message from {:x}",
            sender);
        return;
    }
    held_.emplace_back(wire.begin(), wire.end());
}

void ControlChannel::call(uint64_t sender, std::span<const uint8_t> payload) {
    std::shared_ptr<const MessageHandler> h = handler_;
    std::thread::id outer = delivering_.exchange(std::this_thread::get_id());
    try {
        (*h)(sender, payload);
    } catch (const std::exception& e) {
        // Thrown into rail 0's worker it would end the process.
        dropped_.fetch_add(1, std::memory_order_relaxed);
        log(LogLevel::kError, "fabric", "the message handler threw on a message from {:x}: {}",
            sender, e.what());
    } catch (...) {
        dropped_.fetch_add(1, std::memory_order_relaxed);
        log(LogLevel::kError, "fabric", "the message handler threw on a message from {:x}", sender);
    }
    delivering_.store(outer);
}

void ControlChannel::set_handler(MessageHandler handler) {
    auto h = handler ? std::make_shared<const MessageHandler>(std::move(handler)) : nullptr;
    std::unique_lock lk(mu_, std::defer_lock);
    if (delivering_.load() != std::this_thread::get_id()) lk.lock();  // else held: a handler
    handler_ = std::move(h);
    while (handler_ && !held_.empty()) {
        auto m = std::move(held_.front());
        held_.pop_front();
        uint64_t sender = 0;
        std::memcpy(&sender, m.data() + 4, 8);
        call(sender, std::span<const uint8_t>(m).subspan(kMessageHeader));
    }
}

}  // namespace ferry::detail
