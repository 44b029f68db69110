#include "serve/cost_model.h"

#include <gtest/gtest.h>

#include <vector>

namespace ferry::serve {
namespace {

CostModel qwen(int tp) {
    auto m = CostModel::create(qwen3_32b(), h200(), tp);
    EXPECT_TRUE(m.ok()) << m.status().to_string();
    return *m;
}

TEST(CostModel, Qwen3ShapeHasAbout32BParametersAnd256KiBKvPerToken) {
    ModelShape s = qwen3_32b();
    double params = s.weight_bytes() / s.elem_bytes;
    EXPECT_GT(params, 31e9);
    EXPECT_LT(params, 34e9);
    EXPECT_DOUBLE_EQ(s.kv_bytes_per_token(), 2.0 * 64 * 8 * 128 * 2);
}

TEST(CostModel, PrefillGrowsFasterThanLinearWithLength) {
    CostModel m = qwen(8);
    std::vector<int> l1{1024}, l4{4096}, l16{16384};
    double t1 = m.prefill_seconds(l1), t4 = m.prefill_seconds(l4), t16 = m.prefill_seconds(l16);
    EXPECT_GT(t4, 3.5 * t1);
    // The quadratic attention term shows at 16k: more than 4x the 4k time.
    EXPECT_GT(t16, 4.2 * t4);
    // But the linear term still dominates: far from 16x.
    EXPECT_LT(t16, 8 * t4);
    // Plausible for 32B on 8 H200: a 16k prompt takes a few hundred ms, not seconds.
    EXPECT_GT(t16, 0.1);
    EXPECT_LT(t16, 1.0);
}

TEST(CostModel, ChunkedPrefillDoesTheSameFlopsButPaysPerStepCosts) {
    CostModel m = qwen(8);
    std::vector<int> whole{4096};
    double flops = 0, seconds = 0, context_bytes = 0;
    const int chunk = 512;
    for (int ctx = 0; ctx < 4096; ctx += chunk) {
        std::vector<PrefillChunk> c{{.tokens = chunk, .context = ctx, .last = ctx + chunk == 4096}};
        auto r = m.prefill_roofline(c);
        flops += r.flops;
        seconds += r.total_s;
        context_bytes +=
            r.bytes - m.prefill_roofline(std::vector<PrefillChunk>{
                                             {.tokens = chunk, .context = 0, .last = c[0].last}})
                          .bytes;
    }
    auto one = m.prefill_roofline(whole);
    // Linear and causal-attention work are the same however the prompt is cut (LM head once).
    EXPECT_NEAR(flops, one.flops, one.flops * 1e-9);
    // A chunk reads its context's KV: the 8 chunks read 0 + 512 + ... + 3584 tokens of it.
    EXPECT_NEAR(context_bytes, 14336.0 * qwen3_32b().kv_bytes_per_token() / 8, 1.0);
    // Each step pays the overhead and the all-reduce latencies again: dearer, not by much.
    EXPECT_GT(seconds, one.total_s + 7 * m.config().step_overhead_us * 1e-6);
    EXPECT_LT(seconds, 1.3 * one.total_s);
    // One chunk that is the whole prompt is the unchunked step.
    std::vector<PrefillChunk> all{{.tokens = 4096, .context = 0, .last = true}};
    EXPECT_DOUBLE_EQ(m.prefill_seconds(all), m.prefill_seconds(whole));
}

TEST(CostModel, PrefillIsComputeBoundDecodeIsBandwidthBound) {
    CostModel m = qwen(8);
    std::vector<int> p{4096};
    auto pr = m.prefill_roofline(p);
    EXPECT_GT(pr.compute_s, pr.memory_s);
    std::vector<int> ctx(16, 2048);
    auto dr = m.decode_roofline(ctx);
    EXPECT_GT(dr.memory_s, 5 * dr.compute_s);
}

TEST(CostModel, DecodeStepBarelyGrowsWithBatchButGrowsWithContext) {
    CostModel m = qwen(8);
    std::vector<int> one{1024}, eight(8, 1024), long_ctx(8, 32768);
    double t1 = m.decode_seconds(one), t8 = m.decode_seconds(eight);
    // Weights dominate the bytes: 8 sequences cost far less than 8x one sequence.
    EXPECT_LT(t8, 1.5 * t1);
    EXPECT_GT(t8, t1);
    EXPECT_GT(m.decode_seconds(long_ctx), 1.5 * t8);
    // A TP-8 decode step of a 32B model is milliseconds.
    EXPECT_GT(t1, 1e-3);
    EXPECT_LT(t1, 20e-3);
}

TEST(CostModel, TensorParallelismDividesWork) {
    std::vector<int> p{8192};
    auto r1 = qwen(1).prefill_roofline(p);
    auto r8 = qwen(8).prefill_roofline(p);
    EXPECT_NEAR(r1.flops / r8.flops, 8.0, 1e-9);
    EXPECT_NEAR(r1.compute_s / r8.compute_s, 8.0, 1e-9);
    EXPECT_EQ(r1.comm_s, 0);
    EXPECT_GT(r8.comm_s, 0);
    EXPECT_LT(r8.total_s, r1.total_s / 4);
}

TEST(CostModel, EfficiencyCalibratesComputeTime) {
    CostModelConfig slow;
    slow.compute_efficiency = 0.3;
    auto a = CostModel::create(qwen3_32b(), h200(), 8);
    auto b = CostModel::create(qwen3_32b(), h200(), 8, slow);
    ASSERT_TRUE(a.ok() && b.ok());
    std::vector<int> p{8192};
    EXPECT_NEAR(b->prefill_roofline(p).compute_s / a->prefill_roofline(p).compute_s, 2.0, 1e-9);
}

TEST(CostModel, KvLayoutSplitsHeadsAcrossRanks) {
    kv::KvLayout kv = qwen(8).kv_layout(16, 100);
    EXPECT_EQ(kv.num_kv_heads, 1u);
    EXPECT_EQ(kv.num_layers, 64u);
    EXPECT_EQ(kv.token_bytes() * 2 * kv.num_layers, 64u * 2 * 128 * 2);  // one token, all layers
    EXPECT_EQ(kv.block_bytes(), 64u * 2 * 128 * 2 * 16);
    EXPECT_EQ(kv.pool_bytes(), kv.block_bytes() * 100);
    EXPECT_EQ(kv.placement, kv::KvPlacement::kBlockMajor);
    EXPECT_TRUE(kv.validate().ok());
}

TEST(CostModel, RejectsTpThatDoesNotDivideHeads) {
    auto m = CostModel::create(qwen3_32b(), h200(), 3);
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(m.status().message().find("does not divide"), std::string::npos);
    EXPECT_FALSE(model_by_name("llama-9000").ok());
}

}  // namespace
}  // namespace ferry::serve
