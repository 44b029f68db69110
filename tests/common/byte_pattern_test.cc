// The byte-pattern helpers the fabric tests share (tests/support/byte_pattern.h).
#include "support/byte_pattern.h"

#include <gtest/gtest.h>

#include <vector>

namespace ferry::testing {
namespace {

TEST(BytePattern, ChecksFindTheFirstWrongByteAndNameIt) {
    std::vector<uint8_t> b(4096);
    fill_pattern(b, 7);
    EXPECT_EQ(check_pattern(b, 0, b.size(), 7, 0), "");
    EXPECT_EQ(check_pattern(b, 100, 50, 7, 100), "");
    EXPECT_NE(check_pattern(b, 0, b.size(), 8, 0), "");  // another seed differs
    std::vector<uint8_t> want = b;
    b[1234] ^= 0x40;
    EXPECT_NE(check_pattern(b, 1000, 500, 7, 1000).find("byte 234 of 500"), std::string::npos);
    const std::string diff = compare_bytes(b, want);
    EXPECT_NE(diff.find("byte 1234"), std::string::npos) << diff;
    EXPECT_NE(diff.find("1 bytes wrong"), std::string::npos) << diff;
    EXPECT_EQ(compare_bytes(want, want), "");
    EXPECT_EQ(compare_bytes(b, std::vector<uint8_t>(10)), "size differs");
    std::vector<uint8_t> poison(64, 0xcd);
    EXPECT_EQ(check_fill(poison, 0, 64, 0xcd), "");
    poison[9] = 0;
    EXPECT_NE(check_fill(poison, 8, 8, 0xcd).find("byte 9 of 64"), std::string::npos);
}

}  // namespace
}  // namespace ferry::testing
