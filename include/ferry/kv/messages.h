// Control messages of the KV transfer protocols (push and pull). Every message starts with
// magic, protocol version and type; decoding is strict: a truncated, oversized or
// inconsistent message is a protocol error naming the field, and trailing bytes are refused.
// docs/PROTOCOL.md describes when each is sent.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "ferry/common/status.h"
#include "ferry/fabric/types.h"
#include "ferry/kv/layout.h"

namespace ferry::kv {

inline constexpr uint32_t kKvMagic = 0x46524b56;  // "FRKV"
// 2: chunked push (INTENT, SCHEDULED, SEGMENT; imm_span in REGISTER, segments in FINAL).
// 4: a pull offer's capability in PULL_PARAMS and DONE.
// 5: a pool of several regions (one descriptor per region) in REGISTER and PULL_PARAMS.
// 6: a SEGMENT may close the transfer (`last` and the job's totals), replacing its FINAL.
// 8: CANCEL says whether decode gave the request up (prefill may stop computing it) or only
//    moved to a newer attempt.
// 9: REGISTER's first_token: decode's prefix cache holds the tokens before it, only the rest
//    moves.
// 10: PULL_PARAMS carries the offer's own registrations (windows), closed when the offer ends.
inline constexpr uint16_t kKvProtocolVersion = 11;
// Most regions a pool may have: one per (layer, K/V) of 1024 layers.
inline constexpr uint32_t kMaxPoolRegions = 2048;
// Largest block list a message may carry: 2^20 blocks is 16M tokens at block size 16.
inline constexpr size_t kMaxBlocksPerMessage = 1u << 20;
inline constexpr size_t kMaxReasonLength = 1024;
// Most immediates one registration may hand out (one per segment of a chunked push).
inline constexpr uint32_t kMaxImmSpan = 4096;
// Most windows one PULL_PARAMS may carry (one per contiguous run of the offer's blocks per
// region: 64 layers x K/V x 512 scattered blocks).
inline constexpr uint32_t kMaxPullWindows = 1u << 16;

// A pull offer's capability: 128 random bits prefill draws per offer. Only a DONE that carries
// it releases the offer, so a reader that guessed or was told another transfer's id cannot end
// that transfer; it travels to decode only inside the router-signed kv_transfer_params.
using PullCapability = std::array<uint8_t, 16>;

enum class MsgType : uint8_t {
    kRegister = 1,
    kFinal = 2,
    kFail = 3,
    kCancel = 4,
    kCancelAck = 5,
    kPullParams = 6,
    kDone = 7,
    kIntent = 8,
    kScheduled = 9,
    kSegment = 10,
    kPullAsk = 11,
};

// Decode → every prefill rank that writes into this decode rank (push): "here are my blocks
// for this transfer; write with `imm`".
struct RegisterMsg {
    uint64_t transfer_id = 0;
    uint32_t attempt = 0;      // a larger attempt supersedes every smaller one
    uint32_t decode_rank = 0;  // TP rank and size of the sender
    uint32_t decode_tp = 1;
    // Segment i of this attempt's writes carries immediate imm + i, for i < imm_span; the
    // producer makes no more than imm_span segments.
    uint32_t imm = 0;
    uint32_t imm_span = 1;
    uint32_t num_tokens = 0;
    uint32_t lease_ms = 0;  // prefill gives up waiting for its own completion after this
    EngineAddress decode_address;
    std::vector<MemoryDescriptor> pool;  // one per region, in layout order (KvPoolRegions)
    KvLayout layout;
    std::vector<uint32_t> blocks;
    // Tokens [first_token, num_tokens) move; decode holds the ones before already (its prefix
    // cache). blocks[0] is the block of token first_token (rounded down to a block start).
    // On the wire after num_tokens.
    uint32_t first_token = 0;
};

// What a producer rank wrote for one decode rank in all: FINAL's totals, and those of the
// SEGMENT that closes the transfer.
struct JobTotals {
    uint32_t writes = 0;
    uint64_t bytes = 0;
    uint32_t segments = 0;
    bool operator==(const JobTotals&) const = default;
};

// Prefill rank → decode rank (push): "the writes of tokens [first_token, end_token), layers
// [first_layer, end_layer), are complete; count `writes` immediates of value imm + index". Sent
// once per segment. end_layer 0: every layer (a whole chunk); otherwise a layer group of the
// chunk prefill computes now.
// `last`: the segment drained last with the prompt complete, so it also closes the transfer
// exactly as a FINAL with these totals sent right after it would; the wire carries the totals
// only then. One message instead of two at the end of every push.
struct SegmentMsg {
    uint64_t transfer_id = 0;
    uint32_t attempt = 0;
    uint32_t producer_rank = 0;
    uint32_t index = 0;
    uint32_t first_token = 0;
    uint32_t end_token = 0;
    uint32_t writes = 0;
    uint64_t bytes = 0;
    uint32_t first_layer = 0;
    uint32_t end_layer = 0;
    std::optional<JobTotals> last;
    bool operator==(const SegmentMsg&) const = default;
};

// Prefill rank → decode rank (push): "all my writes are posted and complete, in `segments`
// segments (each announced by a SEGMENT) of `writes` writes in all".
struct FinalMsg {
    uint64_t transfer_id = 0;
    uint32_t attempt = 0;
    uint32_t producer_rank = 0;
    uint32_t writes = 0;
    uint64_t bytes = 0;
    uint32_t segments = 0;
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
    // Decode gave the request up (cancelled, lease passed, shutting down), not superseded the
    // attempt by a newer one: prefill may stop computing the prompt.
    bool given_up = false;
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

// Bytes [offset, offset + desc.length) of pool region `region`, registered for one pull offer
// alone (ConnectorConfig::pull_keys): the offer's reads go there under desc's keys, and prefill
// closes the registration when the offer ends, so a late read under them fails.
struct PullWindow {
    uint32_t region = 0;
    uint64_t offset = 0;
    MemoryDescriptor desc;
};

// Prefill rank → decode (through the router, pull mode): where to read this rank's KV from.
struct PullParamsMsg {
    uint64_t transfer_id = 0;
    uint32_t producer_rank = 0;
    uint32_t producer_tp = 1;
    uint32_t num_tokens = 0;
    uint32_t lease_ms = 0;  // prefill frees the blocks after this even without DONE
    EngineAddress prefill_address;
    std::vector<MemoryDescriptor> pool;  // one per region, in layout order (KvPoolRegions)
    KvLayout layout;
    std::vector<uint32_t> blocks;
    PullCapability capability{};  // what DONE must carry (see PullCapability)
    // The offer's blocks, registered for it alone, in (region, offset) order: decode reads
    // through these, and `pool`'s keys are zero. Empty: read `pool` under its keys (an offer
    // under PullKeys::kPool, or parameters decode built from the handshake).
    std::vector<PullWindow> windows;
    // The answer to a PULL_ASK whose windows do not fit one message comes in parts: each
    // repeats the fields above and carries windows [windows_first, windows_first +
    // windows.size()) of windows_total. windows_total 0: `windows` is the whole list.
    uint32_t windows_first = 0;
    uint32_t windows_total = 0;
};

// Decode rank → prefill rank (pull): finished reading (ok) or gave up; free the blocks.
struct DoneMsg {
    uint64_t transfer_id = 0;
    uint32_t decode_rank = 0;
    uint32_t decode_tp = 1;  // tells prefill how many decode ranks will send DONE
    bool ok = true;
    PullCapability capability{};  // the offer's; a DONE with another is ignored
    bool operator==(const DoneMsg&) const = default;
};

// Decode → prefill rank (pull, parameters built from the handshake: vLLM): "send me the live
// offer of this transfer". Answered with the offer's PULL_PARAMS (its own keys, the lease left)
// while the offer runs, waiting up to wait_ms (capped at prefill's lease) for an offer not
// made yet; else with a FAIL naming why. Only an ask carrying the offer's capability is
// answered with its parameters.
struct PullAskMsg {
    uint64_t transfer_id = 0;
    uint32_t decode_rank = 0;
    uint32_t wait_ms = 0;
    PullCapability capability{};
    EngineAddress decode_address;  // where the answer goes
};

// Decode → each prefill rank that will write into it (push), before decode holds any block:
// "tell me when you schedule this transfer". Lets decode reserve its blocks only once prefill
// admitted the request instead of for the whole time it queues at prefill.
struct IntentMsg {
    uint64_t transfer_id = 0;
    uint32_t attempt = 0;
    uint32_t decode_rank = 0;
    uint32_t decode_tp = 1;
    EngineAddress decode_address;
};

// Prefill rank → decode rank: the transfer's prefill is scheduled (its KV is being computed).
struct ScheduledMsg {
    uint64_t transfer_id = 0;
    uint32_t attempt = 0;
    uint32_t producer_rank = 0;
    bool operator==(const ScheduledMsg&) const = default;
};

// A pull offer's windows alone, as PULL_PARAMS carries them: for an engine whose decode side
// builds the parameters from the handshake and what the request carried (ferry serve's
// "ferry_pull_keys"). Decoding checks each window against a pool of `regions` regions of
// `layout`.
std::vector<uint8_t> encode_pull_windows(std::span<const PullWindow> windows);
Result<std::vector<PullWindow>> decode_pull_windows(std::span<const uint8_t> bytes,
                                                    const KvLayout& layout, size_t regions);

// Alternatives in MsgType order (the wire type is index + 1).
using KvMessage =
    std::variant<RegisterMsg, FinalMsg, FailMsg, CancelMsg, CancelAckMsg, PullParamsMsg, DoneMsg,
                 IntentMsg, ScheduledMsg, SegmentMsg, PullAskMsg>;

std::vector<uint8_t> encode_message(const KvMessage& msg);
Result<KvMessage> decode_message(std::span<const uint8_t> bytes);
// Short name of a message type for logs ("REGISTER", "FINAL", ...).
const char* message_name(const KvMessage& msg);

}  // namespace ferry::kv
