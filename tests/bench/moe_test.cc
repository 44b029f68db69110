#include "bench/moe.h"

#include <gtest/gtest.h>

namespace ferry::moe {
namespace {

TEST(MoeBench, SmallRunReportsEveryPhaseBytesAndAVerifiedCombine) {
    MoeBenchConfig c;
    c.ranks = 4;
    c.ranks_per_node = 2;
    c.tokens = 16;
    c.hidden = 256;
    c.topk = 4;
    c.experts = 16;
    c.private_slots = 4;
    c.warmup = 1;
    c.iters = 4;
    c.timeout = std::chrono::seconds(20);
    auto rep = run_moe_bench(c);
    ASSERT_TRUE(rep.ok()) << rep.status().to_string();
    ASSERT_EQ(rep->phases.size(), 7u);  // the four calls, dispatch, combine, the whole layer
    EXPECT_EQ(rep->phases.back().name, "layer");
    for (const auto& p : rep->phases) {
        EXPECT_GT(p.p50_us, 0.0) << p.name;
        EXPECT_GE(p.p99_us, p.p50_us) << p.name;
    }
    EXPECT_TRUE(rep->verified) << rep->max_rel_error;
    // Every token goes to at least one rank and at most top-k: bytes are bounded both ways.
    EXPECT_GE(rep->dispatch_bytes, uint64_t{4} * 16 * 256);
    EXPECT_EQ(rep->combine_bytes, uint64_t{4} * 16 * 4 * 256 * 2);  // every (token, expert)
    std::string table = format_moe_table(*rep);
    EXPECT_NE(table.find("dispatch_send"), std::string::npos);
    EXPECT_EQ(moe_report_json(*rep)["verified"], true);
}

TEST(MoeBench, UnknownBackendIsRefused) {
    MoeBenchConfig c;
    c.backend = "tpu";
    auto rep = run_moe_bench(c);
    ASSERT_FALSE(rep.ok());
    EXPECT_NE(rep.status().message().find("unknown backend 'tpu'"), std::string::npos);
}

}  // namespace
}  // namespace ferry::moe
