#include "moe/device_proxy.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>

#include "common/enum_names.h"
#include "ferry/common/log.h"
#include "ferry/common/thread_name.h"
#include "ferry/moe/config.h"
#include "ferry/moe/host_proxy.h"

namespace ferry::moe {
namespace {

const char* part_name(uint32_t part) {
    static constexpr EnumName<uint32_t> kNames[] = {
        {proxy::kCounts, "counts"},
        {proxy::kPrivate, "dispatch (private slots)"},
        {proxy::kOverflow, "dispatch (overflow)"},
        {proxy::kCombine, "combine"},
    };
    return name_of(kNames, part, "an unknown part").data();
}

uint64_t records_base(const SharedLayout& layout) { return (layout.total + 63) / 64 * 64; }

constexpr Duration kNap = std::chrono::microseconds(20);

}  // namespace

uint64_t proxy_abort_offset(const SharedLayout& layout, uint32_t world) {
    return records_base(layout) + uint64_t{proxy::kParts} * world * sizeof(proxy::PutRecord);
}

uint64_t proxy_piece_word_offset(const SharedLayout& layout, uint32_t world, uint32_t sender) {
    return proxy_abort_offset(layout, world) + 64 + 8ull * sender;
}

uint64_t proxy_inbox_bytes(const SharedLayout& layout, uint32_t world) {
    return proxy_piece_word_offset(layout, world, 0) + (8ull * world + 63) / 64 * 64;
}

uint64_t proxy_record_offset(const SharedLayout& layout, uint32_t world, uint32_t part,
                             uint32_t sender) {
    return records_base(layout) + (uint64_t{part} * world + sender) * sizeof(proxy::PutRecord);
}

uint32_t DeviceProxy::data_imm(uint32_t base, uint32_t part, uint32_t sender) {
    return base + (part * 2) * kMaxWorldSize + sender;
}

uint32_t DeviceProxy::record_imm(uint32_t base, uint32_t part, uint32_t sender) {
    return base + (part * 2 + 1) * kMaxWorldSize + sender;
}

uint32_t DeviceProxy::piece_imm(uint32_t base, uint32_t world, uint32_t sender, uint32_t piece) {
    return base + 2 * proxy::kParts * kMaxWorldSize + piece * world + sender;
}

DeviceProxy::DeviceProxy(DeviceProxySetup setup)
    : s_(std::move(setup)),
      out_(size_t{s_.world} * proxy::kParts),
      in_(size_t{s_.world} * proxy::kParts),
      raised_dispatch_(s_.world, 0) {
    for (uint32_t r = 0; r < s_.world; ++r)
        if (s_.remote[r]) remotes_.push_back(r);
    if (s_.trace) {
        const size_t n = size_t{s_.world} * proxy::kParts * kStamps;
        stamps_ = std::make_unique<std::atomic<uint64_t>[]>(n);
        for (size_t i = 0; i < n; ++i) stamps_[i].store(0, std::memory_order_relaxed);
    }
}

uint64_t system_clock_ns() {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count());
}

uint64_t DeviceProxy::gpu_now() const {
    return static_cast<uint64_t>(static_cast<int64_t>(system_clock_ns()) + s_.clock_offset_ns);
}

void DeviceProxy::stamp(uint32_t peer, uint32_t part, Stamp what, uint64_t gpu_ns) {
    if (!stamps_) return;
    auto* at = &stamps_[(size_t{peer} * proxy::kParts + part) * kStamps];
    // A new call's first stamp clears what the last call left behind.
    if (what == kPublished)
        for (uint32_t i = kSeen; i < kStamps; ++i)
            if (i != kArrived) at[i].store(0, std::memory_order_relaxed);
    if (what == kArrived && part == proxy::kCounts)
        for (uint32_t p = proxy::kCounts + 1; p < proxy::kParts; ++p)
            stamps_[(size_t{peer} * proxy::kParts + p) * kStamps + kArrived].store(
                0, std::memory_order_relaxed);
    at[what].store(gpu_ns ? gpu_ns : gpu_now(), std::memory_order_relaxed);
}

std::vector<ProxyStamps> DeviceProxy::last_stamps() const {
    std::vector<ProxyStamps> out;
    if (!stamps_) return out;
    for (uint32_t d : remotes_)
        for (uint32_t part = 0; part < proxy::kParts; ++part) {
            const auto* at = &stamps_[(size_t{d} * proxy::kParts + part) * kStamps];
            auto get = [&](Stamp w) { return at[w].load(std::memory_order_relaxed); };
            out.push_back(
                {d, part, get(kPublished), get(kSeen), get(kPosted), get(kWritten), get(kArrived)});
        }
    return out;
}

DeviceProxy::~DeviceProxy() { stop(); }

void DeviceProxy::start() {
    if (thread_.joinable()) return;
    thread_ = std::thread([this] {
        set_thread_name("ferry-gpuproxy");
        loop();
    });
}

void DeviceProxy::stop() {
    stop_.store(true, std::memory_order_relaxed);
    if (thread_.joinable()) thread_.join();
    // Writes in flight read the outbox: they finish or fail within the engine's op_timeout.
    for (auto& f : inflight_) (void)f.op.wait(s_.engine->config().op_timeout + seconds(1));
    inflight_.clear();
    for (auto& o : out_) o.record = OpHandle();
}

Status DeviceProxy::error() const {
    std::lock_guard lk(mu_);
    return error_;
}

void DeviceProxy::fail(const Status& s) {
    // Only the proxy thread fails. The kernels are stopped before the error is visible, so a
    // caller that sees it finds them giving up already.
    if (failed_.exchange(true)) return;
    std::atomic_ref<uint32_t>(
        *reinterpret_cast<uint32_t*>(s_.inbox_data + proxy_abort_offset(s_.layout, s_.world)))
        .store(1, std::memory_order_release);
    log(LogLevel::kError, "moe", "rank {} cuda host proxy: {}", s_.rank, s.to_string());
    std::lock_guard lk(mu_);
    error_ = s;
}

bool DeviceProxy::in_bounds(uint32_t part, uint32_t sender, uint64_t offset, uint64_t len) const {
    const SharedLayout& l = s_.layout;
    uint64_t lo = 0, hi = 0;
    switch (part) {
        case proxy::kCounts:
            return offset == l.counts + sender * s_.counts_bytes && len == s_.counts_bytes;
        case proxy::kPrivate:
        case proxy::kOverflow:
            lo = l.dispatch;
            hi = l.combine;
            break;
        case proxy::kCombine:
            lo = l.combine;
            hi = l.total;
            break;
        default:
            return false;
    }
    return offset >= lo && offset <= hi && len <= hi - offset;
}

void DeviceProxy::loop() {
    TimePoint last_activity = Clock::now();
    // While this proxy spins, the engine's workers poll too: on shm and tcp a peer's writes
    // progress only while this side polls, and nobody waits on their immediates (the proxy
    // counts them itself), so the workers would otherwise nap between arrivals.
    ArrivalsExpected awake(s_.engine);
    while (!stop_.load(std::memory_order_relaxed)) {
        bool active = reap();
        if (!failed_.load(std::memory_order_acquire)) {
            active |= send();
            active |= receive();
        }
        if (active) {
            last_activity = Clock::now();
            if (!awake.active()) awake = ArrivalsExpected(s_.engine);
        } else if (Clock::now() - last_activity < s_.idle_spin) {
            std::this_thread::yield();
        } else {
            awake.reset();
            std::this_thread::sleep_for(kNap);
        }
    }
}

bool DeviceProxy::reap() {
    size_t before = inflight_.size();
    for (size_t i = 0; i < inflight_.size();) {
        const Inflight& f = inflight_[i];
        if (!f.op.done()) {
            ++i;
            continue;
        }
        Status st = f.op.wait(Duration::zero());
        if (!st.ok())
            fail(st.with_context(fmt::format("rank {}, {} put of call {} to rank {}", s_.rank,
                                             part_name(f.part), f.seq, f.peer)));
        Outgoing& o = out_[size_t{f.peer} * proxy::kParts + f.part];
        // Written: the last data write of a put whose writes are all posted completed.
        if (f.data && f.seq == o.call && o.data_left > 0 && --o.data_left == 0 && !o.streaming)
            stamp(f.peer, f.part, kWritten);
        inflight_[i] = std::move(inflight_.back());
        inflight_.pop_back();
    }
    return inflight_.size() != before;
}

OpHandle DeviceProxy::write(uint32_t d, uint64_t src_offset, uint64_t dst_offset, uint64_t len,
                            uint32_t imm) {
    WriteOp op;
    op.peer = s_.peer[d];
    op.src = s_.outbox;
    op.src_offset = src_offset;
    op.dst = &s_.inbox[d];
    op.dst_offset = dst_offset;
    op.length = len;
    op.imm = imm;
    return s_.engine->write(op);
}

std::string DeviceProxy::put_name(uint32_t d, uint32_t part, uint32_t seq) const {
    return fmt::format("rank {}, {} put of call {} to rank {}", s_.rank, part_name(part), seq, d);
}

bool DeviceProxy::post_data(uint32_t d, uint32_t part, Outgoing& o, uint64_t offset, uint64_t len) {
    TransferEngine& engine = *s_.engine;
    const uint64_t slab = s_.outbox_offset[d];
    const uint64_t chunk = s_.chunk_bytes && !o.by_piece ? s_.chunk_bytes : len;
    // By piece: this is piece o.stream_posted, one write (stream() checked that it is).
    const uint32_t imm = o.by_piece ? piece_imm(s_.imm_base, s_.world, s_.rank, o.stream_posted)
                                    : data_imm(s_.imm_base, part, s_.rank);
    for (uint64_t at = 0; at < len; at += chunk) {
        const uint64_t n = std::min(chunk, len - at);
        if (o.by_piece && write_pieces(engine.config(), engine.num_rails(), n) != 1) {
            fail(internal_error(fmt::format("{}: a piece of {} bytes takes more than one write",
                                            put_name(d, part, o.call), n)));
            return false;
        }
        OpHandle h = write(d, slab + offset + at, offset + at, n, imm);
        // The record announces what the engine's split rule says; a write that failed at once
        // or split otherwise must not be announced (the receiver would take stale inbox bytes
        // for this call's).
        const uint64_t want = write_pieces(engine.config(), engine.num_rails(), n);
        Status posted = h.done() ? h.wait(Duration::zero()) : ok_status();
        if (!posted.ok()) {
            fail(posted.with_context(put_name(d, part, o.call)));
            return false;
        }
        if (h.imm_writes() != want && !h.done()) {
            fail(internal_error(fmt::format(
                "{}: the engine put {} immediates on the wire for {} bytes, expected {}",
                put_name(d, part, o.call), h.imm_writes(), n, want)));
            return false;
        }
        o.pieces += static_cast<uint32_t>(want);
        ++o.data_left;
        inflight_.push_back({std::move(h), d, part, o.call, true});
    }
    return true;
}

void DeviceProxy::post_record(uint32_t d, uint32_t part, Outgoing& o, uint64_t offset,
                              uint64_t len) {
    const uint64_t slab = s_.outbox_offset[d];
    const uint64_t rec_at = proxy_record_offset(s_.layout, s_.world, part, s_.rank);
    proxy::PutRecord rec{offset, len, o.call, o.pieces, o.by_piece ? 1u : 0u, 0};
    std::memcpy(static_cast<uint8_t*>(s_.outbox->data()) + slab + rec_at, &rec, sizeof(rec));
    o.record = write(d, slab + rec_at, rec_at, sizeof(rec), record_imm(s_.imm_base, part, s_.rank));
    inflight_.push_back({o.record, d, part, o.call, false});
    o.sent_seq = o.call;
    stamp(d, part, kPosted);
}

bool DeviceProxy::stream(uint32_t d, uint32_t part, Outgoing& o) {
    bool any = false;
    const uint32_t* ready = s_.stream_ready + size_t{d} * s_.stream_max_pieces;
    while (o.stream_posted < o.stream_pieces) {
        const uint32_t i = o.stream_posted;
        if (std::atomic_ref<const uint32_t>(ready[i]).load(std::memory_order_acquire) != o.call)
            return any;
        const uint64_t at = uint64_t{i} * s_.stream_piece_bytes;
        const uint64_t n = std::min(s_.stream_piece_bytes, o.len - at);
        if (!post_data(d, part, o, o.offset + at, n)) return true;
        ++o.stream_posted;
        any = true;
    }
    o.streaming = false;
    post_record(d, part, o, o.offset, o.len);
    o.by_piece = false;
    return true;
}

bool DeviceProxy::send() {
    bool any = false;
    for (uint32_t d : remotes_) {
        for (uint32_t part = 0; part < proxy::kParts; ++part) {
            Outgoing& o = out_[size_t{d} * proxy::kParts + part];
            if (o.streaming) {
                if (stream(d, part, o)) any = true;
                if (failed_.load(std::memory_order_relaxed)) return true;
                continue;
            }
            const volatile proxy::Publish& pub = s_.publish[size_t{d} * proxy::kParts + part];
            const uint32_t seq = pub.seq;
            if (seq == o.sent_seq) continue;
            // The record slot is rewritten below: its last write must be done. By the
            // protocol's order it always is by now; if not, look again next round.
            if (o.record.valid() && !o.record.done()) continue;
            std::atomic_thread_fence(std::memory_order_acquire);
            const uint64_t offset = pub.offset, len = pub.len;
            const bool streamed = pub.streamed != 0;
            if (stamps_) {
                stamp(d, part, kPublished, pub.stamp_ns);
                stamp(d, part, kSeen);
            }
            if (seq != o.sent_seq + 1) {
                fail(protocol_error(fmt::format(
                    "{}: the kernels published call {} after call {}; a call was skipped",
                    put_name(d, part, seq), seq, o.sent_seq)));
                return true;
            }
            if (!in_bounds(part, s_.rank, offset, len)) {
                fail(protocol_error(
                    fmt::format("{}: {} bytes at offset {} fall outside the part's region",
                                put_name(d, part, seq), len, offset)));
                return true;
            }
            o.call = seq;
            o.data_left = 0;
            o.pieces = 0;
            any = true;
            if (streamed) {
                const uint64_t piece = s_.stream_piece_bytes;
                const uint64_t pieces = piece ? (len + piece - 1) / piece : 0;
                if (!s_.stream_ready || pieces > s_.stream_max_pieces) {
                    fail(protocol_error(fmt::format(
                        "{}: a streamed put of {} bytes, but this proxy streams at most {} "
                        "pieces of {} bytes",
                        put_name(d, part, seq), len, s_.stream_max_pieces, piece)));
                    return true;
                }
                o.streaming = true;
                o.offset = offset;
                o.len = len;
                o.stream_posted = 0;
                o.stream_pieces = static_cast<uint32_t>(pieces);
                // Piece by piece where every piece is one write of the engine's (the receiver
                // counts one piece immediate each), else counted whole by the record.
                o.by_piece = part == proxy::kCombine &&
                             (!s_.chunk_bytes || piece <= s_.chunk_bytes) &&
                             write_pieces(s_.engine->config(), s_.engine->num_rails(), piece) == 1;
                stream(d, part, o);
                if (failed_.load(std::memory_order_relaxed)) return true;
                continue;
            }
            if (!post_data(d, part, o, offset, len)) return true;
            post_record(d, part, o, offset, len);
        }
    }
    return any;
}

bool DeviceProxy::receive() {
    bool any = false;
    TransferEngine& engine = *s_.engine;
    for (uint32_t s : remotes_) {
        for (uint32_t part = 0; part < proxy::kParts; ++part) {
            Incoming& in = in_[size_t{s} * proxy::kParts + part];
            if (part == proxy::kCombine) {
                any |= take_pieces(s, in);
                if (failed_.load(std::memory_order_relaxed)) return true;
            }
            const uint32_t rec_imm = record_imm(s_.imm_base, part, s);
            if (!in.have_record) {
                if (engine.imm_available(rec_imm) == 0) continue;
                // Only this thread consumes these immediates: the one seen is there to take.
                Status st = engine.wait_imm(rec_imm, 1, Duration::zero());
                if (!st.ok()) {
                    fail(st.with_context(fmt::format("rank {}: taking a record arrival", s_.rank)));
                    return true;
                }
                std::memcpy(&in.record,
                            s_.inbox_data + proxy_record_offset(s_.layout, s_.world, part, s),
                            sizeof(in.record));
                const proxy::PutRecord& r = in.record;
                if (r.seq != in.next_seq || !in_bounds(part, s, r.offset, r.len)) {
                    fail(protocol_error(fmt::format(
                        "rank {}: rank {} announced a {} put of call {} ({} bytes at offset {}), "
                        "expected call {} inside the part's region; is every rank making the "
                        "same calls with the same config?",
                        s_.rank, s, part_name(part), r.seq, r.len, r.offset, in.next_seq)));
                    return true;
                }
                in.have_record = true;
                in.record_at = Clock::now();
                any = true;
            }
            if (in.record.by_piece) {
                // Its pieces came with piece immediates: complete once all are taken.
                if (part != proxy::kCombine || in.pieces_in > in.record.pieces) {
                    fail(protocol_error(fmt::format(
                        "rank {}: rank {} announced a {} put of call {} in {} piece(s), but {} "
                        "piece write(s) arrived",
                        s_.rank, s, part_name(part), in.record.seq, in.record.pieces,
                        in.pieces_in)));
                    return true;
                }
                if (in.pieces_in < in.record.pieces) {
                    if (Clock::now() - in.record_at > s_.timeout) {
                        fail(timeout_error(fmt::format(
                            "rank {}: the {} put of call {} from rank {} announced {} piece(s), "
                            "{} arrived within {} ms; the peer or the fabric may have died",
                            s_.rank, part_name(part), in.record.seq, s, in.record.pieces,
                            in.pieces_in, to_ms(s_.timeout))));
                        return true;
                    }
                    continue;
                }
                in.pieces_in = 0;
                complete(part, s, in.record);
                in.have_record = false;
                ++in.next_seq;
                any = true;
                continue;
            }
            const uint32_t dimm = data_imm(s_.imm_base, part, s);
            const uint64_t pieces = in.record.pieces;
            if (pieces > 0 && engine.imm_available(dimm) < pieces) {
                if (Clock::now() - in.record_at > s_.timeout) {
                    fail(timeout_error(fmt::format(
                        "rank {}: the {} put of call {} from rank {} announced {} write(s), "
                        "{} arrived within {} ms; the peer or the fabric may have died",
                        s_.rank, part_name(part), in.record.seq, s, pieces,
                        engine.imm_available(dimm), to_ms(s_.timeout))));
                    return true;
                }
                continue;
            }
            if (pieces > 0) {
                Status st = engine.wait_imm(dimm, pieces, Duration::zero());
                if (!st.ok()) {
                    fail(st.with_context(fmt::format("rank {}: taking data arrivals", s_.rank)));
                    return true;
                }
            }
            complete(part, s, in.record);
            in.have_record = false;
            ++in.next_seq;
            any = true;
        }
    }
    return any;
}

bool DeviceProxy::take_pieces(uint32_t s, Incoming& in) {
    // Only the calls' order makes these immediates this call's: a peer sends call N+1's
    // combine after this rank's kernels consumed call N's, and they finish a call only once
    // its counter is raised, after its record came and every piece was taken here.
    const uint32_t before = in.pieces_in;
    while (s_.engine->try_take_imm(piece_imm(s_.imm_base, s_.world, s, in.pieces_in), 1))
        ++in.pieces_in;
    if (in.pieces_in == before) return false;
    std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(
                                  s_.inbox_data + proxy_piece_word_offset(s_.layout, s_.world, s)))
        .store((uint64_t{in.next_seq} << 32) | in.pieces_in, std::memory_order_release);
    return true;
}

void DeviceProxy::raise(uint64_t offset, uint64_t value) {
    // The put's bytes are in the inbox already (its immediates were taken): the release
    // store orders them before the counter for the kernels' acquire.
    std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(s_.inbox_data + offset))
        .store(value, std::memory_order_release);
}

void DeviceProxy::complete(uint32_t part, uint32_t s, const proxy::PutRecord& rec) {
    const SharedLayout& l = s_.layout;
    stamp(s, part, kArrived);
    switch (part) {
        case proxy::kCounts:
            raise(l.ctr_counts + 8ull * s, rec.seq);
            return;
        case proxy::kCombine:
            raise(l.ctr_combine + 8ull * s, uint64_t{rec.seq} * s_.combine_blocks);
            return;
        default: {
            // The dispatch counter counts both parts: raised to the call both have reached.
            const uint32_t other = part == proxy::kPrivate ? proxy::kOverflow : proxy::kPrivate;
            const uint32_t other_done = in_[size_t{s} * proxy::kParts + other].next_seq - 1;
            const uint32_t both = std::min(rec.seq, other_done);
            if (both <= raised_dispatch_[s]) return;
            raised_dispatch_[s] = both;
            raise(l.ctr_dispatch + 8ull * s, uint64_t{both} * s_.dispatch_blocks);
            return;
        }
    }
}

}  // namespace ferry::moe
