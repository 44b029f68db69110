#include "common/enum_names.h"

#include <gtest/gtest.h>

#include "ferry/common/status.h"
#include "ferry/kv/layout.h"
#include "ferry/kv/transfer_mode.h"
#include "ferry/moe/config.h"

namespace ferry {
namespace {

enum class Colour { kRed = 1, kGreen = 2, kBlue = 7 };
constexpr EnumName<Colour> kColours[] = {
    {Colour::kRed, "red"},
    {Colour::kGreen, "green"},
    {Colour::kBlue, "blue"},
    {Colour::kBlue, "azure"},  // an alias
};

TEST(EnumNames, NamesParsesAndListsFromOneTable) {
    static_assert(name_of(kColours, Colour::kGreen) == "green");
    EXPECT_EQ(name_of(kColours, Colour::kBlue), "blue");  // the first name of a value
    EXPECT_EQ(name_of(kColours, Colour(5)), "unknown");
    EXPECT_EQ(name_of(kColours, Colour(5), "no colour"), "no colour");
    EXPECT_EQ(parse_name(kColours, "azure"), Colour::kBlue);
    EXPECT_EQ(parse_name(kColours, "Red"), std::nullopt);  // exact names only
    EXPECT_EQ(name_list(kColours), "red, green, blue or azure");
}

// What the library's names looked like before they shared the table, unchanged.
TEST(EnumNames, LibraryNamesAndParsersKeepTheirWords) {
    EXPECT_EQ(status_code_name(StatusCode::kProtocol), "protocol error");
    EXPECT_EQ(status_code_name(StatusCode(200)), "unknown");
    EXPECT_EQ(kv::to_string(kv::TransferMode::kPullInline), "pull-inline");
    auto bad = kv::parse_transfer_mode("push2");
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().message(),
              "unknown KV transfer mode 'push2': use push, pull or pull-inline");
    EXPECT_EQ(kv::parse_region_split("per-layer-kv").value(), kv::RegionSplit::kPerLayerKv);
    EXPECT_EQ(kv::parse_region_split("x").status().message(),
              "unknown region split 'x': one, per-layer or per-layer-kv");
    EXPECT_STREQ(kv::placement_name(kv::KvPlacement::kBlockMajor), "block-major");
    moe::DType d = moe::DType::kBf16;
    EXPECT_TRUE(moe::parse_dtype("fp8", &d));
    EXPECT_EQ(d, moe::DType::kFp8E4M3);
    EXPECT_EQ(moe::dtype_name(d), "fp8_e4m3");
    EXPECT_FALSE(moe::parse_dtype("fp16", &d));
    EXPECT_EQ(d, moe::DType::kFp8E4M3);  // untouched on failure
    moe::CombineMode m = moe::CombineMode::kPerHit;
    EXPECT_TRUE(moe::parse_combine_mode("per-rank", &m));
    EXPECT_EQ(moe::combine_mode_name(m), "per-rank");
}

}  // namespace
}  // namespace ferry
