#include "ferry/kv/messages.h"

#include <gtest/gtest.h>

#include "ferry/common/bytes.h"

namespace ferry::kv {
namespace {

KvLayout test_layout() {
    KvLayout l;
    l.num_layers = 4;
    l.num_kv_heads = 2;
    l.head_dim = 64;
    l.elem_size = 2;
    l.block_size = 16;
    l.num_blocks = 100;
    l.placement = KvPlacement::kJoint;
    l.order = BlockOrder::kHND;
    return l;
}

MemoryDescriptor test_pool(const KvLayout& l) {
    MemoryDescriptor d;
    d.engine_id = 77;
    d.base = 0x10000;
    d.length = l.pool_bytes();
    d.rail_keys = {5, 6};
    return d;
}

EngineAddress test_address() {
    EngineAddress a;
    a.engine_id = 77;
    a.provider = "tcp;ofi_rxm";
    a.host_id = "h";
    a.rail_addrs = {{1, 2, 3}};
    a.signal.engine_id = 77;
    a.signal.length = 64;
    a.signal.rail_keys = {9};
    return a;
}

// The last segment of a job, closing it with the job's totals (version 6).
SegmentMsg closing_segment() {
    return SegmentMsg{1234, 3, 0, 1, 48, 60, 3, 2048, 0, 0, JobTotals{11, 9000, 4}};
}

std::vector<KvMessage> all_messages() {
    KvLayout l = test_layout();
    RegisterMsg reg{1234,           3, 1,         2, 0xabc, 8, 40, 5000, test_address(),
                    {test_pool(l)}, l, {7, 9, 99}};
    PullParamsMsg pull{99, 1, 2, 17, 3000, test_address(), {test_pool(l)}, l, {4, 5}};
    // The offer's own registration of its blocks (protocol 10).
    pull.windows.push_back({0, 4 * l.slab_bytes(), test_pool(l)});
    pull.windows[0].desc.length = 2 * l.slab_bytes();
    RegisterMsg partial = reg;  // decode's prefix cache holds tokens [0, 20)
    partial.first_token = 20;
    partial.blocks = {9, 99};
    // A decode asking for the live offer (protocol 11).
    PullAskMsg ask{99, 1, 2500, {1, 2, 3}, test_address()};
    return {reg,
            FinalMsg{1234, 3, 1, 88, 1 << 20, 3},
            FailMsg{1234, 3, 0, StatusCode::kTimeout, "lease expired"},
            CancelMsg{1234, 3, 1, false},
            CancelAckMsg{1234, 3, 0},
            pull,
            DoneMsg{99, 1, 2, false},
            IntentMsg{1234, 3, 1, 2, test_address()},
            ScheduledMsg{1234, 3, 0},
            SegmentMsg{1234, 3, 0, 2, 32, 48, 5, 4096, 8, 16, std::nullopt},
            closing_segment(),
            CancelMsg{1234, 4, 1, true},
            partial,
            ask};
}

TEST(KvMessages, ChunkedPushFieldsOutOfRangeAreRejected) {
    KvLayout l = test_layout();
    auto refused = [](const KvMessage& m, const char* field) {
        auto r = decode_message(encode_message(m));
        EXPECT_FALSE(r.ok()) << field;
        if (!r.ok()) {
            EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status().message();
        }
    };
    refused(RegisterMsg{1, 1, 0, 1, 0x10, 0, 4, 100, test_address(), {test_pool(l)}, l, {1}},
            "imm_span");
    refused(RegisterMsg{1, 1, 0, 1, 0xffffffffu, 2, 4, 100, test_address(), {test_pool(l)}, l, {1}},
            "imm_span");
    refused(SegmentMsg{1, 1, 0, 0, 48, 48, 1, 10}, "end_token");
    refused(SegmentMsg{1, 1, 0, kMaxImmSpan, 0, 16, 1, 10}, "index");
    refused(SegmentMsg{1, 1, 0, 0, 0, 16, 1, 10, 8, 8}, "end_layer");
    refused(SegmentMsg{1, 1, 0, 0, 0, 16, 1, 10, 3, 0}, "end_layer");
    refused(FinalMsg{1, 1, 0, 4, 10, kMaxImmSpan + 1}, "segments");
    SegmentMsg closing = closing_segment();
    closing.last->segments = closing.index;  // the totals must count this segment
    refused(closing, "'segments' = 1");
    closing.last->segments = kMaxImmSpan + 1;
    refused(closing, "segments");
    closing = closing_segment();
    closing.last->writes = closing.writes - 1;
    refused(closing, "total_writes");
    closing = closing_segment();
    closing.last->bytes = closing.bytes - 1;
    refused(closing, "total_bytes");
    refused(IntentMsg{1, 1, 2, 2, test_address()}, "decode_rank");
    RegisterMsg past{1, 1, 0, 1, 0x10, 2, 40, 100, test_address(), {test_pool(l)}, l, {1}};
    past.first_token = 41;
    refused(past, "first_token");
    // Tokens [16, 40) need two blocks from token 16 on.
    RegisterMsg short_list{1, 1, 0, 1, 0x10, 2, 40, 100, test_address(), {test_pool(l)}, l, {1}};
    short_list.first_token = 20;
    refused(short_list, "num_tokens");
}

TEST(KvMessages, PartialRegisterKeepsItsFirstToken) {
    KvLayout l = test_layout();
    RegisterMsg m{1, 1, 0, 1, 0x10, 2, 40, 100, test_address(), {test_pool(l)}, l, {3, 4}};
    m.first_token = 20;
    auto back = decode_message(encode_message(m));
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(std::get<RegisterMsg>(*back).first_token, 20u);
    EXPECT_EQ(std::get<RegisterMsg>(*back).blocks, (std::vector<uint32_t>{3, 4}));
}

// The answer to a PULL_ASK in parts (protocol 11): a part keeps which windows it carries; a
// whole list decodes as such; a part outside its total is rejected, naming it.
TEST(KvMessages, PullParamsPartKeepsItsPlaceAndOneOutsideItsTotalIsRejected) {
    PullParamsMsg part = std::get<PullParamsMsg>(all_messages()[5]);
    part.windows_first = 2;
    part.windows_total = 5;
    auto back = decode_message(encode_message(part));
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(std::get<PullParamsMsg>(*back).windows_first, 2u);
    EXPECT_EQ(std::get<PullParamsMsg>(*back).windows_total, 5u);
    part.windows_first = 0;
    part.windows_total = 1;  // window 0 of 1: the whole list
    back = decode_message(encode_message(part));
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(std::get<PullParamsMsg>(*back).windows_total, 0u);
    for (auto [first, total] : {std::pair{5u, 5u}, {4u, 2u}, {0u, kMaxPullWindows + 1}}) {
        part.windows_first = first;
        part.windows_total = total;
        auto bad = decode_message(encode_message(part));
        ASSERT_FALSE(bad.ok()) << first << " of " << total;
        EXPECT_NE(bad.status().message().find("windows_"), std::string::npos)
            << bad.status().to_string();
    }
}

TEST(KvMessages, EveryTypeRoundTrips) {
    for (const KvMessage& m : all_messages()) {
        auto bytes = encode_message(m);
        auto back = decode_message(bytes);
        ASSERT_TRUE(back.ok()) << message_name(m) << ": " << back.status().to_string();
        EXPECT_EQ(back->index(), m.index());
        // Re-encoding what was decoded gives the same bytes: no field was lost or changed.
        EXPECT_EQ(encode_message(*back), bytes) << message_name(m);
    }
}

TEST(KvMessages, EveryTruncationAndTrailingByteIsRejected) {
    for (const KvMessage& m : all_messages()) {
        auto bytes = encode_message(m);
        for (size_t cut = 0; cut < bytes.size(); ++cut) {
            auto r = decode_message(std::span<const uint8_t>(bytes).first(cut));
            ASSERT_FALSE(r.ok()) << message_name(m) << " cut at " << cut;
            EXPECT_EQ(r.status().code(), StatusCode::kProtocol);
            EXPECT_NE(r.status().message().find("field"), std::string::npos)
                << r.status().message();
        }
        bytes.push_back(0);
        auto r = decode_message(bytes);
        ASSERT_FALSE(r.ok()) << message_name(m);
        EXPECT_NE(r.status().message().find("trailing"), std::string::npos);
    }
}

TEST(KvMessages, ClosingSegmentKeepsItsTotalsAndAPlainOneCarriesNone) {
    auto back = decode_message(encode_message(closing_segment()));
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(std::get<SegmentMsg>(*back), closing_segment());
    SegmentMsg plain = closing_segment();
    plain.last.reset();
    auto bytes = encode_message(plain);
    // A plain SEGMENT ends with last = 0; the totals are not on the wire.
    EXPECT_EQ(bytes.size() + 16, encode_message(closing_segment()).size());
    EXPECT_EQ(bytes.back(), 0);
    back = decode_message(bytes);
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_FALSE(std::get<SegmentMsg>(*back).last.has_value());
    // `last` is a boolean; a closing SEGMENT cut inside its totals names the missing field.
    bytes.back() = 2;
    auto r = decode_message(bytes);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("field 'last' = 2 is not a boolean"), std::string::npos)
        << r.status().message();
    auto closing = encode_message(closing_segment());
    r = decode_message(std::span<const uint8_t>(closing).first(closing.size() - 4));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kProtocol);
    EXPECT_NE(r.status().message().find("segments"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("KV message type 10"), std::string::npos)
        << r.status().message();
}

TEST(KvMessages, MalformedFieldsAreNamed) {
    auto expect_error = [](const KvMessage& m, std::string_view needle) {
        auto r = decode_message(encode_message(m));
        ASSERT_FALSE(r.ok()) << message_name(m) << " should be refused (" << needle << ")";
        EXPECT_EQ(r.status().code(), StatusCode::kProtocol);
        EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
    };
    auto msgs = all_messages();
    {
        auto back = decode_message(encode_message(msgs[0]));
        ASSERT_TRUE(back.ok());
        const auto& r = std::get<RegisterMsg>(*back);
        EXPECT_EQ(r.blocks, (std::vector<uint32_t>{7, 9, 99}));
        EXPECT_EQ(r.decode_address.provider, "tcp;ofi_rxm");
        EXPECT_EQ(r.layout, test_layout());
        EXPECT_EQ(r.imm, 0xabcu);
    }
    RegisterMsg reg = std::get<RegisterMsg>(msgs[0]);
    RegisterMsg bad = reg;
    bad.blocks[1] = 100;
    expect_error(bad, "blocks[1]");
    bad = reg;
    bad.decode_rank = 2;
    expect_error(bad, "decode_rank");
    bad = reg;
    bad.num_tokens = 49;  // 3 blocks of 16
    expect_error(bad, "num_tokens");
    bad = reg;
    bad.pool[0].length -= 1;
    expect_error(bad, "pool[0].length");
    bad = reg;
    bad.layout.head_dim = 0;
    expect_error(bad, "layout");
    PullParamsMsg pull = std::get<PullParamsMsg>(msgs[5]);
    pull.producer_tp = 0;
    expect_error(pull, "producer_tp");
    pull = std::get<PullParamsMsg>(msgs[5]);
    pull.windows[0].offset = pull.layout.region_bytes() - 1;  // runs past the region
    expect_error(pull, "windows[0]");
    FailMsg fail = std::get<FailMsg>(msgs[2]);
    fail.code = StatusCode::kOk;
    expect_error(fail, "code");

    auto cancel = encode_message(CancelMsg{1, 1, 0, true});
    cancel.back() = 2;  // given_up is a flag
    auto flag = decode_message(cancel);
    ASSERT_FALSE(flag.ok());
    EXPECT_NE(flag.status().message().find("'given_up'"), std::string::npos);

    auto bytes = encode_message(CancelMsg{1, 1, 0});
    bytes[6] = 42;  // type
    auto r = decode_message(bytes);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("'type' = 42"), std::string::npos);
    bytes[4] = 99;  // version
    r = decode_message(bytes);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("'version'"), std::string::npos);
    bytes[0] ^= 1;  // magic
    r = decode_message(bytes);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("'magic'"), std::string::npos);
}

TEST(KvLayout, RoundTripsAndHashIgnoresWhatTheMappingHandles) {
    KvLayout l = test_layout();
    ByteWriter w;
    l.encode(w);
    auto bytes = w.take();
    ByteReader r(bytes);
    auto back = KvLayout::decode(r);
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(*back, l);
    for (size_t cut = 0; cut < bytes.size(); ++cut) {
        ByteReader rc(std::span<const uint8_t>(bytes).first(cut));
        EXPECT_FALSE(KvLayout::decode(rc).ok()) << cut;
    }
    KvLayout other = l;
    other.block_size = 32;
    other.num_kv_heads = 8;
    other.order = BlockOrder::kNHD;
    other.placement = KvPlacement::kSeparate;
    EXPECT_EQ(other.compatibility_hash(), l.compatibility_hash());
    other.elem_size = 1;
    EXPECT_NE(other.compatibility_hash(), l.compatibility_hash());
}

TEST(KvLayout, OffsetsTileThePoolExactly) {
    // Every element byte of the pool belongs to exactly one (layer, part, block, slot, head).
    for (auto place : {KvPlacement::kSeparate, KvPlacement::kJoint, KvPlacement::kBlockMajor}) {
        for (auto order : {BlockOrder::kNHD, BlockOrder::kHND}) {
            KvLayout l = test_layout();
            l.num_blocks = 3;
            l.head_dim = 4;
            l.num_layers = 2;
            l.placement = place;
            l.order = order;
            std::vector<int> hits(l.pool_bytes(), 0);
            for (uint32_t layer = 0; layer < l.num_layers; ++layer)
                for (KvPart p : {KvPart::kK, KvPart::kV})
                    for (uint32_t b = 0; b < l.num_blocks; ++b)
                        for (uint32_t s = 0; s < l.block_size; ++s)
                            for (uint32_t h = 0; h < l.num_kv_heads; ++h)
                                for (uint64_t i = 0; i < l.head_bytes(); ++i)
                                    hits[l.offset(layer, p, b, s, h) + i]++;
            for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i], 1) << i;
        }
    }
}

}  // namespace
}  // namespace ferry::kv
