// Control messages of the KV transfer protocols (push and pull). Every message starts with
// magic, protocol version and type; decoding is strict: a truncated, oversized or
// inconsistent message is a protocol error naming the field, and trailing bytes are refused.
// docs/PROTOCOL.md describes when each is sent.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "ferry/common/status.h"
#include "ferry/fabric/types.h"
#include "ferry/kv/layout.h"

namespace ferry::kv {

inline constexpr uint32_t kKvMagic = 0x46524b56;  // "FRKV"
inline constexpr uint16_t kKvProtocolVersion = 1;
// Largest block list a message may carry: 2^20 blocks is 16M tokens at block size 16.
inline constexpr size_t kMaxBlocksPerMessage = 1u << 20;
inline constexpr size_t kMaxReasonLength = 1024;

enum class MsgType : uint8_t {
    kRegister = 1,
    kFinal = 2,
    kFail = 3,
    kCancel = 4,
    kCancelAck = 5,
    kPullParams = 6,
    kDone = 7,
};

// Decode → every prefill rank that writes into this decode rank (push): "here are my blocks
// for this transfer; write with `imm`".
struct RegisterMsg {
    uint64_t transfer_id = 0;
    uint32_t attempt = 0;      // a larger attempt supersedes every smaller one
    uint32_t decode_rank = 0;  // TP rank and size of the sender
    uint32_t decode_tp = 1;
    uint32_t imm = 0;  // immediate the producer puts on every write of this attempt
    uint32_t num_tokens = 0;
    uint32_t lease_ms = 0;  // prefill gives up waiting for its own completion after this
    EngineAddress decode_address;
    MemoryDescriptor pool;
    KvLayout layout;
    std::vector<uint32_t> blocks;
};

// Prefill rank → decode rank (push): "all my writes are posted and complete; count `writes`
// immediates".
struct FinalMsg {
    uint64_t transfer_id = 0;
    uint32_t attempt = 0;
    uint32_t producer_rank = 0;
    uint32_t writes = 0;
    uint64_t bytes = 0;
    bool operator==(const FinalMsg&) const = default;
};

// Either direction: the transfer attempt failed and the sender released its side.
struct FailMsg {
    uint64_t transfer_id = 0;
    uint32_t attempt = 0;
    uint32_t sender_rank = 0;
    StatusCode code = StatusCode::kInternal;
    std::string reason;
    bool operator==(const FailMsg&) const = default;
};

// Decode → prefill: stop writing into this attempt's blocks.
struct CancelMsg {
    uint64_t transfer_id = 0;
    uint32_t attempt = 0;
    uint32_t decode_rank = 0;
    bool operator==(const CancelMsg&) const = default;
};

// Prefill → decode: no write of this attempt is in flight any more and none will be posted;
// decode may reuse the blocks.
struct CancelAckMsg {
    uint64_t transfer_id = 0;
    uint32_t attempt = 0;
    uint32_t producer_rank = 0;
    bool operator==(const CancelAckMsg&) const = default;
};

// Prefill rank → decode (through the router, pull mode): where to read this rank's KV from.
struct PullParamsMsg {
    uint64_t transfer_id = 0;
    uint32_t producer_rank = 0;
    uint32_t producer_tp = 1;
    uint32_t num_tokens = 0;
    uint32_t lease_ms = 0;  // prefill frees the blocks after this even without DONE
    EngineAddress prefill_address;
    MemoryDescriptor pool;
    KvLayout layout;
    std::vector<uint32_t> blocks;
};

// Decode rank → prefill rank (pull): finished reading (ok) or gave up; free the blocks.
struct DoneMsg {
    uint64_t transfer_id = 0;
    uint32_t decode_rank = 0;
    uint32_t decode_tp = 1;  // tells prefill how many decode ranks will send DONE
    bool ok = true;
    bool operator==(const DoneMsg&) const = default;
};

using KvMessage =
    std::variant<RegisterMsg, FinalMsg, FailMsg, CancelMsg, CancelAckMsg, PullParamsMsg, DoneMsg>;

std::vector<uint8_t> encode_message(const KvMessage& msg);
Result<KvMessage> decode_message(std::span<const uint8_t> bytes);
// Short name of a message type for logs ("REGISTER", "FINAL", ...).
const char* message_name(const KvMessage& msg);

}  // namespace ferry::kv
