#include "ferry/kv/messages.h"

#include <fmt/format.h>

#include "ferry/common/bytes.h"
#include "ferry/kv/pool.h"

namespace ferry::kv {
namespace {

// The part REGISTER and PULL_PARAMS share: where a rank's KV lives and how it is laid out.
void encode_location(ByteWriter& w, const EngineAddress& address,
                     const std::vector<MemoryDescriptor>& pool, const KvLayout& layout,
                     const std::vector<uint32_t>& blocks) {
    address.encode(w);
    w.put(static_cast<uint32_t>(pool.size()));
    for (const MemoryDescriptor& d : pool) d.encode(w);
    layout.encode(w);
    w.put_vector(blocks);
}

// `first_token`: blocks[0] is the block of that token (a partial REGISTER); 0 elsewhere.
Status decode_location(ByteReader& r, uint32_t first_token, uint32_t num_tokens,
                       EngineAddress* address, std::vector<MemoryDescriptor>* pool,
                       KvLayout* layout, std::vector<uint32_t>* blocks) {
    FERRY_ASSIGN_OR_RETURN(*address, EngineAddress::decode(r));
    uint32_t regions = 0;
    FERRY_RETURN_IF_ERROR(r.get(&regions, "pool.count"));
    if (regions == 0 || regions > kMaxPoolRegions) {
        return protocol_error(
            fmt::format("field 'pool.count' = {} is not in [1, {}]", regions, kMaxPoolRegions));
    }
    pool->clear();
    for (uint32_t i = 0; i < regions; ++i) {
        FERRY_ASSIGN_OR_RETURN(auto d, MemoryDescriptor::decode(r));
        pool->push_back(std::move(d));
    }
    FERRY_ASSIGN_OR_RETURN(*layout, KvLayout::decode(r));
    FERRY_RETURN_IF_ERROR(r.get_vector(blocks, "blocks", kMaxBlocksPerMessage));
    for (size_t i = 0; i < blocks->size(); ++i) {
        if ((*blocks)[i] >= layout->num_blocks) {
            return protocol_error(
                fmt::format("field 'blocks[{}]' = {} is outside the pool of {} "
                            "blocks",
                            i, (*blocks)[i], layout->num_blocks));
        }
    }
    const uint64_t skipped = first_token - first_token % layout->block_size;
    if (first_token < num_tokens &&
        num_tokens - skipped > uint64_t{blocks->size()} * layout->block_size) {
        return protocol_error(
            fmt::format("field 'num_tokens' = {} does not fit in {} blocks of {} "
                        "tokens from token {}",
                        num_tokens, blocks->size(), layout->block_size, skipped));
    }
    return check_pool_descriptors(*pool, *layout);
}

Status check_rank(uint32_t rank, uint32_t tp, const char* rank_field, const char* tp_field) {
    if (tp == 0) return protocol_error(fmt::format("field '{}' is 0", tp_field));
    if (rank >= tp) {
        return protocol_error(
            fmt::format("field '{}' = {} is not below '{}' = {}", rank_field, rank, tp_field, tp));
    }
    return ok_status();
}

void encode_body(ByteWriter& w, const RegisterMsg& m) {
    w.put(m.transfer_id);
    w.put(m.attempt);
    w.put(m.decode_rank);
    w.put(m.decode_tp);
    w.put(m.imm);
    w.put(m.imm_span);
    w.put(m.num_tokens);
    w.put(m.first_token);
    w.put(m.lease_ms);
    encode_location(w, m.decode_address, m.pool, m.layout, m.blocks);
}

Status decode_body(ByteReader& r, RegisterMsg* m) {
    FERRY_RETURN_IF_ERROR(r.get(&m->transfer_id, "transfer_id"));
    FERRY_RETURN_IF_ERROR(r.get(&m->attempt, "attempt"));
    FERRY_RETURN_IF_ERROR(r.get(&m->decode_rank, "decode_rank"));
    FERRY_RETURN_IF_ERROR(r.get(&m->decode_tp, "decode_tp"));
    FERRY_RETURN_IF_ERROR(r.get(&m->imm, "imm"));
    FERRY_RETURN_IF_ERROR(r.get(&m->imm_span, "imm_span"));
    if (m->imm_span == 0 || m->imm_span > kMaxImmSpan) {
        return protocol_error(
            fmt::format("field 'imm_span' = {} is outside [1, {}]", m->imm_span, kMaxImmSpan));
    }
    if (uint64_t{m->imm} + m->imm_span - 1 > UINT32_MAX) {
        return protocol_error("field 'imm_span' runs past the largest immediate");
    }
    FERRY_RETURN_IF_ERROR(r.get(&m->num_tokens, "num_tokens"));
    FERRY_RETURN_IF_ERROR(r.get(&m->first_token, "first_token"));
    if (m->first_token > m->num_tokens) {
        return protocol_error(fmt::format("field 'first_token' = {} is past 'num_tokens' = {}",
                                          m->first_token, m->num_tokens));
    }
    FERRY_RETURN_IF_ERROR(r.get(&m->lease_ms, "lease_ms"));
    FERRY_RETURN_IF_ERROR(check_rank(m->decode_rank, m->decode_tp, "decode_rank", "decode_tp"));
    return decode_location(r, m->first_token, m->num_tokens, &m->decode_address, &m->pool,
                           &m->layout, &m->blocks);
}

void encode_body(ByteWriter& w, const FinalMsg& m) {
    w.put(m.transfer_id);
    w.put(m.attempt);
    w.put(m.producer_rank);
    w.put(m.writes);
    w.put(m.bytes);
    w.put(m.segments);
}

Status decode_body(ByteReader& r, FinalMsg* m) {
    FERRY_RETURN_IF_ERROR(r.get(&m->transfer_id, "transfer_id"));
    FERRY_RETURN_IF_ERROR(r.get(&m->attempt, "attempt"));
    FERRY_RETURN_IF_ERROR(r.get(&m->producer_rank, "producer_rank"));
    FERRY_RETURN_IF_ERROR(r.get(&m->writes, "writes"));
    FERRY_RETURN_IF_ERROR(r.get(&m->bytes, "bytes"));
    FERRY_RETURN_IF_ERROR(r.get(&m->segments, "segments"));
    if (m->segments > kMaxImmSpan) {
        return protocol_error(
            fmt::format("field 'segments' = {} is above {}", m->segments, kMaxImmSpan));
    }
    return ok_status();
}

void encode_body(ByteWriter& w, const SegmentMsg& m) {
    w.put(m.transfer_id);
    w.put(m.attempt);
    w.put(m.producer_rank);
    w.put(m.index);
    w.put(m.first_token);
    w.put(m.end_token);
    w.put(m.writes);
    w.put(m.bytes);
    w.put(m.first_layer);
    w.put(m.end_layer);
    w.put(static_cast<uint8_t>(m.last.has_value()));
    if (m.last) {
        w.put(m.last->writes);
        w.put(m.last->bytes);
        w.put(m.last->segments);
    }
}

// The closing part of a SEGMENT: totals that cover the segment itself.
Status decode_last(ByteReader& r, SegmentMsg* m) {
    uint8_t last = 0;
    FERRY_RETURN_IF_ERROR(r.get(&last, "last"));
    if (last > 1) return protocol_error(fmt::format("field 'last' = {} is not a boolean", last));
    if (last == 0) return ok_status();
    JobTotals& t = m->last.emplace();
    FERRY_RETURN_IF_ERROR(r.get(&t.writes, "total_writes"));
    FERRY_RETURN_IF_ERROR(r.get(&t.bytes, "total_bytes"));
    FERRY_RETURN_IF_ERROR(r.get(&t.segments, "segments"));
    if (t.segments <= m->index || t.segments > kMaxImmSpan) {
        return protocol_error(fmt::format("field 'segments' = {} is not in ['index' + 1 = {}, {}]",
                                          t.segments, m->index + 1, kMaxImmSpan));
    }
    if (t.writes < m->writes || t.bytes < m->bytes) {
        return protocol_error(fmt::format(
            "field 'total_writes' / 'total_bytes' = {} / {} is below the segment's own {} / {}",
            t.writes, t.bytes, m->writes, m->bytes));
    }
    return ok_status();
}

Status decode_body(ByteReader& r, SegmentMsg* m) {
    FERRY_RETURN_IF_ERROR(r.get(&m->transfer_id, "transfer_id"));
    FERRY_RETURN_IF_ERROR(r.get(&m->attempt, "attempt"));
    FERRY_RETURN_IF_ERROR(r.get(&m->producer_rank, "producer_rank"));
    FERRY_RETURN_IF_ERROR(r.get(&m->index, "index"));
    if (m->index >= kMaxImmSpan) {
        return protocol_error(
            fmt::format("field 'index' = {} is not below {}", m->index, kMaxImmSpan));
    }
    FERRY_RETURN_IF_ERROR(r.get(&m->first_token, "first_token"));
    FERRY_RETURN_IF_ERROR(r.get(&m->end_token, "end_token"));
    if (m->first_token >= m->end_token) {
        return protocol_error(fmt::format("field 'end_token' = {} is not above 'first_token' = {}",
                                          m->end_token, m->first_token));
    }
    FERRY_RETURN_IF_ERROR(r.get(&m->writes, "writes"));
    FERRY_RETURN_IF_ERROR(r.get(&m->bytes, "bytes"));
    FERRY_RETURN_IF_ERROR(r.get(&m->first_layer, "first_layer"));
    FERRY_RETURN_IF_ERROR(r.get(&m->end_layer, "end_layer"));
    if (m->end_layer == 0 ? m->first_layer != 0 : m->first_layer >= m->end_layer) {
        return protocol_error(fmt::format(
            "field 'end_layer' = {} does not close a layer range from 'first_layer' = {}",
            m->end_layer, m->first_layer));
    }
    return decode_last(r, m);
}

void encode_body(ByteWriter& w, const IntentMsg& m) {
    w.put(m.transfer_id);
    w.put(m.attempt);
    w.put(m.decode_rank);
    w.put(m.decode_tp);
    m.decode_address.encode(w);
}

Status decode_body(ByteReader& r, IntentMsg* m) {
    FERRY_RETURN_IF_ERROR(r.get(&m->transfer_id, "transfer_id"));
    FERRY_RETURN_IF_ERROR(r.get(&m->attempt, "attempt"));
    FERRY_RETURN_IF_ERROR(r.get(&m->decode_rank, "decode_rank"));
    FERRY_RETURN_IF_ERROR(r.get(&m->decode_tp, "decode_tp"));
    FERRY_RETURN_IF_ERROR(check_rank(m->decode_rank, m->decode_tp, "decode_rank", "decode_tp"));
    FERRY_ASSIGN_OR_RETURN(m->decode_address, EngineAddress::decode(r));
    return ok_status();
}

void encode_body(ByteWriter& w, const ScheduledMsg& m) {
    w.put(m.transfer_id);
    w.put(m.attempt);
    w.put(m.producer_rank);
}

Status decode_body(ByteReader& r, ScheduledMsg* m) {
    FERRY_RETURN_IF_ERROR(r.get(&m->transfer_id, "transfer_id"));
    FERRY_RETURN_IF_ERROR(r.get(&m->attempt, "attempt"));
    FERRY_RETURN_IF_ERROR(r.get(&m->producer_rank, "producer_rank"));
    return ok_status();
}

void encode_body(ByteWriter& w, const FailMsg& m) {
    w.put(m.transfer_id);
    w.put(m.attempt);
    w.put(m.sender_rank);
    w.put(static_cast<uint8_t>(m.code));
    w.put_string(m.reason);
}

Status decode_body(ByteReader& r, FailMsg* m) {
    uint8_t code = 0;
    FERRY_RETURN_IF_ERROR(r.get(&m->transfer_id, "transfer_id"));
    FERRY_RETURN_IF_ERROR(r.get(&m->attempt, "attempt"));
    FERRY_RETURN_IF_ERROR(r.get(&m->sender_rank, "sender_rank"));
    FERRY_RETURN_IF_ERROR(r.get(&code, "code"));
    if (code == 0 || code > static_cast<uint8_t>(StatusCode::kAlreadyExists)) {
        return protocol_error(fmt::format("field 'code' = {} is not an error code", code));
    }
    m->code = static_cast<StatusCode>(code);
    FERRY_RETURN_IF_ERROR(r.get_string(&m->reason, "reason", kMaxReasonLength));
    return ok_status();
}

void encode_body(ByteWriter& w, const CancelMsg& m) {
    w.put(m.transfer_id);
    w.put(m.attempt);
    w.put(m.decode_rank);
    w.put<uint8_t>(m.given_up ? 1 : 0);
}

Status decode_body(ByteReader& r, CancelMsg* m) {
    FERRY_RETURN_IF_ERROR(r.get(&m->transfer_id, "transfer_id"));
    FERRY_RETURN_IF_ERROR(r.get(&m->attempt, "attempt"));
    FERRY_RETURN_IF_ERROR(r.get(&m->decode_rank, "decode_rank"));
    uint8_t given_up = 0;
    FERRY_RETURN_IF_ERROR(r.get(&given_up, "given_up"));
    if (given_up > 1)
        return protocol_error(fmt::format("field 'given_up' = {} is not 0 or 1", given_up));
    m->given_up = given_up == 1;
    return ok_status();
}

void encode_body(ByteWriter& w, const CancelAckMsg& m) {
    w.put(m.transfer_id);
    w.put(m.attempt);
    w.put(m.producer_rank);
}

Status decode_body(ByteReader& r, CancelAckMsg* m) {
    FERRY_RETURN_IF_ERROR(r.get(&m->transfer_id, "transfer_id"));
    FERRY_RETURN_IF_ERROR(r.get(&m->attempt, "attempt"));
    FERRY_RETURN_IF_ERROR(r.get(&m->producer_rank, "producer_rank"));
    return ok_status();
}

void encode_windows(ByteWriter& w, std::span<const PullWindow> windows) {
    w.put(static_cast<uint32_t>(windows.size()));
    for (const PullWindow& win : windows) {
        w.put(win.region);
        w.put(win.offset);
        win.desc.encode(w);
    }
}

Status decode_windows(ByteReader& r, const KvLayout& layout, size_t regions,
                      std::vector<PullWindow>* out) {
    uint32_t count = 0;
    FERRY_RETURN_IF_ERROR(r.get(&count, "windows.count"));
    if (count > kMaxPullWindows) {
        return protocol_error(
            fmt::format("field 'windows.count' = {} is above {}", count, kMaxPullWindows));
    }
    out->clear();
    const uint64_t region_bytes = layout.region_bytes();
    for (uint32_t i = 0; i < count; ++i) {
        PullWindow win;
        FERRY_RETURN_IF_ERROR(r.get(&win.region, "windows.region"));
        FERRY_RETURN_IF_ERROR(r.get(&win.offset, "windows.offset"));
        FERRY_ASSIGN_OR_RETURN(win.desc, MemoryDescriptor::decode(r));
        if (win.region >= regions || win.desc.length == 0 || win.offset > region_bytes ||
            win.desc.length > region_bytes - win.offset) {
            return protocol_error(
                fmt::format("field 'windows[{}]' (region {}, {} bytes at {}) is not inside the "
                            "pool's {} regions of {} bytes",
                            i, win.region, win.desc.length, win.offset, regions, region_bytes));
        }
        if (!out->empty() && std::pair{out->back().region, out->back().offset} >=
                                 std::pair{win.region, win.offset}) {
            return protocol_error(fmt::format(
                "field 'windows[{}]' is not after windows[{}] in (region, offset) order", i,
                i - 1));
        }
        out->push_back(std::move(win));
    }
    return ok_status();
}

void encode_body(ByteWriter& w, const PullParamsMsg& m) {
    w.put(m.transfer_id);
    w.put(m.producer_rank);
    w.put(m.producer_tp);
    w.put(m.num_tokens);
    w.put(m.lease_ms);
    encode_location(w, m.prefill_address, m.pool, m.layout, m.blocks);
    w.put(m.capability);
    w.put(m.windows_first);
    w.put(m.windows_total != 0 ? m.windows_total : static_cast<uint32_t>(m.windows.size()));
    encode_windows(w, m.windows);
}

Status decode_body(ByteReader& r, PullParamsMsg* m) {
    FERRY_RETURN_IF_ERROR(r.get(&m->transfer_id, "transfer_id"));
    FERRY_RETURN_IF_ERROR(r.get(&m->producer_rank, "producer_rank"));
    FERRY_RETURN_IF_ERROR(r.get(&m->producer_tp, "producer_tp"));
    FERRY_RETURN_IF_ERROR(r.get(&m->num_tokens, "num_tokens"));
    FERRY_RETURN_IF_ERROR(r.get(&m->lease_ms, "lease_ms"));
    FERRY_RETURN_IF_ERROR(
        check_rank(m->producer_rank, m->producer_tp, "producer_rank", "producer_tp"));
    FERRY_RETURN_IF_ERROR(decode_location(r, 0, m->num_tokens, &m->prefill_address, &m->pool,
                                          &m->layout, &m->blocks));
    FERRY_RETURN_IF_ERROR(r.get(&m->capability, "capability"));
    FERRY_RETURN_IF_ERROR(r.get(&m->windows_first, "windows_first"));
    FERRY_RETURN_IF_ERROR(r.get(&m->windows_total, "windows_total"));
    if (m->windows_total > kMaxPullWindows) {
        return protocol_error(fmt::format("field 'windows_total' = {} is above {}",
                                          m->windows_total, kMaxPullWindows));
    }
    FERRY_RETURN_IF_ERROR(decode_windows(r, m->layout, m->pool.size(), &m->windows));
    const uint64_t end = uint64_t{m->windows_first} + m->windows.size();
    if (end > m->windows_total || (m->windows.empty() && m->windows_total != 0)) {
        return protocol_error(fmt::format(
            "field 'windows_first' = {} with {} windows is not a part of windows_total = {}",
            m->windows_first, m->windows.size(), m->windows_total));
    }
    if (m->windows_first == 0 && end == m->windows_total) m->windows_total = 0;  // whole
    return ok_status();
}

void encode_body(ByteWriter& w, const PullAskMsg& m) {
    w.put(m.transfer_id);
    w.put(m.decode_rank);
    w.put(m.wait_ms);
    w.put(m.capability);
    m.decode_address.encode(w);
}

Status decode_body(ByteReader& r, PullAskMsg* m) {
    FERRY_RETURN_IF_ERROR(r.get(&m->transfer_id, "transfer_id"));
    FERRY_RETURN_IF_ERROR(r.get(&m->decode_rank, "decode_rank"));
    FERRY_RETURN_IF_ERROR(r.get(&m->wait_ms, "wait_ms"));
    FERRY_RETURN_IF_ERROR(r.get(&m->capability, "capability"));
    FERRY_ASSIGN_OR_RETURN(m->decode_address, EngineAddress::decode(r));
    return ok_status();
}

void encode_body(ByteWriter& w, const DoneMsg& m) {
    w.put(m.transfer_id);
    w.put(m.decode_rank);
    w.put(m.decode_tp);
    w.put(static_cast<uint8_t>(m.ok));
    w.put(m.capability);
}

Status decode_body(ByteReader& r, DoneMsg* m) {
    uint8_t ok = 0;
    FERRY_RETURN_IF_ERROR(r.get(&m->transfer_id, "transfer_id"));
    FERRY_RETURN_IF_ERROR(r.get(&m->decode_rank, "decode_rank"));
    FERRY_RETURN_IF_ERROR(r.get(&m->decode_tp, "decode_tp"));
    FERRY_RETURN_IF_ERROR(r.get(&ok, "ok"));
    FERRY_RETURN_IF_ERROR(r.get(&m->capability, "capability"));
    FERRY_RETURN_IF_ERROR(check_rank(m->decode_rank, m->decode_tp, "decode_rank", "decode_tp"));
    if (ok > 1) return protocol_error(fmt::format("field 'ok' = {} is not a boolean", ok));
    m->ok = ok != 0;
    return ok_status();
}

template <typename M>
Result<KvMessage> decode_as(ByteReader& r) {
    M m;
    FERRY_RETURN_IF_ERROR(decode_body(r, &m));
    if (r.remaining() != 0) {
        return protocol_error(fmt::format("{} trailing bytes after the message", r.remaining()));
    }
    return KvMessage(std::move(m));
}

}  // namespace

std::vector<uint8_t> encode_message(const KvMessage& msg) {
    ByteWriter w;
    w.put(kKvMagic);
    w.put(kKvProtocolVersion);
    // Variant alternatives are declared in MsgType order, starting at 1.
    w.put(static_cast<uint8_t>(msg.index() + 1));
    std::visit([&](const auto& m) { encode_body(w, m); }, msg);
    return w.take();
}

Result<KvMessage> decode_message(std::span<const uint8_t> bytes) {
    ByteReader r(bytes);
    uint32_t magic = 0;
    uint16_t version = 0;
    uint8_t type = 0;
    FERRY_RETURN_IF_ERROR(r.get(&magic, "magic"));
    if (magic != kKvMagic) {
        return protocol_error(fmt::format("field 'magic' is {:#x}: not a ferry KV message", magic));
    }
    FERRY_RETURN_IF_ERROR(r.get(&version, "version"));
    if (version != kKvProtocolVersion) {
        return protocol_error(
            fmt::format("field 'version' is {}, this build speaks {}; upgrade "
                        "both sides",
                        version, kKvProtocolVersion));
    }
    FERRY_RETURN_IF_ERROR(r.get(&type, "type"));
    Result<KvMessage> out = protocol_error("unset");
    switch (static_cast<MsgType>(type)) {
        case MsgType::kRegister:
            out = decode_as<RegisterMsg>(r);
            break;
        case MsgType::kFinal:
            out = decode_as<FinalMsg>(r);
            break;
        case MsgType::kFail:
            out = decode_as<FailMsg>(r);
            break;
        case MsgType::kCancel:
            out = decode_as<CancelMsg>(r);
            break;
        case MsgType::kCancelAck:
            out = decode_as<CancelAckMsg>(r);
            break;
        case MsgType::kPullParams:
            out = decode_as<PullParamsMsg>(r);
            break;
        case MsgType::kDone:
            out = decode_as<DoneMsg>(r);
            break;
        case MsgType::kIntent:
            out = decode_as<IntentMsg>(r);
            break;
        case MsgType::kScheduled:
            out = decode_as<ScheduledMsg>(r);
            break;
        case MsgType::kSegment:
            out = decode_as<SegmentMsg>(r);
            break;
        case MsgType::kPullAsk:
            out = decode_as<PullAskMsg>(r);
            break;
        default:
            return protocol_error(fmt::format("field 'type' = {} is unknown", type));
    }
    if (!out.ok()) {
        return out.status().with_context(fmt::format("KV message type {}", type));
    }
    return out;
}

const char* message_name(const KvMessage& msg) {
    static constexpr const char* kNames[] = {"REGISTER",   "FINAL",       "FAIL",    "CANCEL",
                                             "CANCEL_ACK", "PULL_PARAMS", "DONE",    "INTENT",
                                             "SCHEDULED",  "SEGMENT",     "PULL_ASK"};
    return kNames[msg.index()];
}

std::vector<uint8_t> encode_pull_windows(std::span<const PullWindow> windows) {
    ByteWriter w;
    encode_windows(w, windows);
    return w.take();
}

Result<std::vector<PullWindow>> decode_pull_windows(std::span<const uint8_t> bytes,
                                                    const KvLayout& layout, size_t regions) {
    ByteReader r(bytes);
    std::vector<PullWindow> out;
    FERRY_RETURN_IF_ERROR(decode_windows(r, layout, regions, &out));
    if (r.remaining() != 0) {
        return protocol_error(fmt::format("{} trailing bytes after the windows", r.remaining()));
    }
    return out;
}

}  // namespace ferry::kv
