#include "ferry/common/status.h"

#include <gtest/gtest.h>

#include "ferry/common/bytes.h"
#include "ferry/fabric/types.h"

namespace ferry {
namespace {

Result<int> half(int x) {
    if (x % 2) return invalid_argument("odd number");
    return x / 2;
}

Status quarter(int x, int* out) {
    FERRY_ASSIGN_OR_RETURN(int h, half(x));
    FERRY_ASSIGN_OR_RETURN(*out, half(h));
    return ok_status();
}

TEST(Status, PropagatesFirstErrorWithItsMessage) {
    int out = 0;
    EXPECT_TRUE(quarter(8, &out).ok());
    EXPECT_EQ(out, 2);
    Status s = quarter(6, &out);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(s.to_string(), "invalid argument: odd number");
    EXPECT_EQ(s.with_context("quarter(6)").message(), "quarter(6): odd number");
}

TEST(Bytes, TruncatedInputNamesTheField) {
    ByteWriter w;
    w.put<uint32_t>(7);
    auto blob = w.take();
    ByteReader r(blob);
    uint32_t a = 0;
    uint64_t b = 0;
    ASSERT_TRUE(r.get(&a, "a").ok());
    Status s = r.get(&b, "block count");
    EXPECT_EQ(s.code(), StatusCode::kProtocol);
    EXPECT_NE(s.message().find("block count"), std::string::npos) << s.message();
}

TEST(Bytes, OversizedVectorCountIsRejectedBeforeAllocating) {
    ByteWriter w;
    w.put<uint32_t>(0xffffffff);
    auto blob = w.take();
    ByteReader r(blob);
    std::vector<uint64_t> v;
    Status s = r.get_vector(&v, "keys", 64);
    EXPECT_EQ(s.code(), StatusCode::kProtocol);
    EXPECT_NE(s.message().find("keys"), std::string::npos);
}

TEST(Types, DescriptorRoundTripsAndRejectsOtherVersions) {
    MemoryDescriptor d;
    d.engine_id = 0x1234;
    d.base = 0x7f0000001000;
    d.length = 1 << 20;
    d.virt_addr = false;
    d.rail_keys = {11, 22};
    auto blob = d.serialize();
    auto back = MemoryDescriptor::deserialize(blob);
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(back->base, d.base);
    EXPECT_EQ(back->rail_keys, d.rail_keys);
    EXPECT_FALSE(back->virt_addr);
    EXPECT_EQ(back->wire_address(16), 16u);

    blob[4] = 99;  // version field
    auto bad = MemoryDescriptor::deserialize(blob);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("version 99"), std::string::npos)
        << bad.status().message();

    for (size_t cut = 0; cut < blob.size(); ++cut) {
        auto t = MemoryDescriptor::deserialize(std::span(blob).first(cut));
        EXPECT_FALSE(t.ok()) << "accepted a descriptor cut at " << cut;
    }
}

TEST(Types, DescriptorCarriesWhichRailsHoldTheRegion) {
    MemoryDescriptor d;
    d.engine_id = 7;
    d.length = 4096;
    d.rail_keys = {0, 0, 33, 44};
    d.rail_mask = 0b1100;
    auto back = MemoryDescriptor::deserialize(d.serialize());
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(back->rail_mask, 0b1100u);
    EXPECT_FALSE(back->on_rail(0));
    EXPECT_TRUE(back->on_rail(2));
    EXPECT_FALSE(back->on_rail(4));  // no such rail, whatever the mask says

    EXPECT_EQ(back->near_rails(), 0b1100u);  // no near rail named: every rail holding it
    d.near_mask = 0b1000;
    back = MemoryDescriptor::deserialize(d.serialize());
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(back->near_mask, 0b1000u);  // the owner's rails near the memory travel too
    EXPECT_EQ(back->near_rails(), 0b1000u);

    // Near rails none of which holds the region: a peer would aim at rails without a key.
    d.near_mask = 0b0011;
    auto off = MemoryDescriptor::deserialize(d.serialize());
    ASSERT_FALSE(off.ok());
    EXPECT_NE(off.status().message().find("near mask"), std::string::npos)
        << off.status().message();

    // Keys but no rail holding them: nothing could ever reach the region.
    d.near_mask = ~uint64_t{0};
    d.rail_mask = 0b10000;
    auto bad = MemoryDescriptor::deserialize(d.serialize());
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("rail mask"), std::string::npos)
        << bad.status().message();
}

TEST(Types, HexRoundTrip) {
    std::vector<uint8_t> b = {0, 1, 0xab, 0xff};
    EXPECT_EQ(to_hex(b), "0001abff");
    auto back = from_hex("0001ABff");
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, b);
    EXPECT_FALSE(from_hex("0g").ok());
}

}  // namespace
}  // namespace ferry
