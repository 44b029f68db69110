// Control messages: the wire framing (magic, sender's engine id, payload), the user's handler
// and the messages held until one is set. Messages travel as two-sided sends on rail 0, whose
// worker calls deliver().
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "fabric/rail.h"
#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"

namespace ferry::detail {

class ControlChannel {
  public:
    explicit ControlChannel(const EngineConfig& config) : config_(config) {}

    // kInvalidArgument when the payload exceeds max_message_size.
    Status check_size(size_t payload_size) const;
    // The send operation carrying payload from engine `sender` to `dest` (rail 0's address of
    // peer `peer`).
    FabricOp* make_send(uint64_t sender, PeerId peer, fi_addr_t dest,
                        std::span<const uint8_t> payload, TimePoint deadline) const;
    // Runs on rail 0's worker for every message received: to the handler, or held.
    void deliver(std::span<const uint8_t> wire);
    // Delivers the held messages to the new handler first, in arrival order. Called by a
    // handler, it takes effect at once (the running one finishes its call); from another
    // thread, it returns once no call of the old handler is running.
    void set_handler(MessageHandler handler);
    // Malformed messages, those dropped because too many were held, and those whose handler
    // threw.
    uint64_t dropped() const { return dropped_.load(); }

  private:
    // With mu_ held: the handler, kept alive for the call even if it replaces itself.
    void call(uint64_t sender, std::span<const uint8_t> payload);

    const EngineConfig& config_;
    std::mutex mu_;
    std::shared_ptr<const MessageHandler> handler_;
    // The thread running a handler (it holds mu_), so that set_handler from inside a handler
    // does not lock mu_ again: that deadlocked rail 0's worker for good.
    std::atomic<std::thread::id> delivering_{};
    std::deque<std::vector<uint8_t>> held_;
    std::atomic<uint64_t> dropped_{0};
};

}  // namespace ferry::detail
