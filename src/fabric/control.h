// Control messages: the wire framing (magic, sender's engine id, payload), the user's handler
// and the messages held until one is set. Messages travel as two-sided sends on rail 0, whose
// worker calls deliver().
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <mutex>
#include <span>
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
    // Delivers the held messages to the new handler first, in arrival order.
    void set_handler(MessageHandler handler);
    // Malformed messages and those dropped because too many were held.
    uint64_t dropped() const { return dropped_.load(); }

  private:
    const EngineConfig& config_;
    std::mutex mu_;
    MessageHandler handler_;
    std::deque<std::vector<uint8_t>> held_;
    std::atomic<uint64_t> dropped_{0};
};

}  // namespace ferry::detail
