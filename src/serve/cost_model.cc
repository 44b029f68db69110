#include "serve/cost_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace ferry::serve {

double ModelShape::matmul_params() const {
    double h = hidden;
    double q = double(q_heads) * head_dim;
    double kv = double(kv_heads) * head_dim;
    double attn = h * q + 2 * h * kv + q * h;  // q, k, v, o projections
    double mlp = 3 * h * intermediate;         // gate, up, down
    return layers * (attn + mlp) + h * vocab;  // + LM head
}

double ModelShape::weight_bytes() const {
    return (matmul_params() + double(hidden) * vocab) * elem_bytes;  // + embedding table
}

double ModelShape::kv_bytes_per_token() const {
    return 2.0 * layers * kv_heads * head_dim * elem_bytes;
}

ModelShape qwen3_32b() {
    return ModelShape{.name = "qwen3-32b",
                      .layers = 64,
                      .hidden = 5120,
                      .q_heads = 64,
                      .kv_heads = 8,
                      .head_dim = 128,
                      .intermediate = 25600,
                      .vocab = 151936};
}

ModelShape tiny_test_model() {
    return ModelShape{.name = "tiny",
                      .layers = 2,
                      .hidden = 256,
                      .q_heads = 4,
                      .kv_heads = 2,
                      .head_dim = 16,
                      .intermediate = 512,
                      .vocab = 1000};
}

GpuSpec h200() {
    // Dense bf16 peak without sparsity; HBM3e; NVLink 4 at 900 GB/s bidirectional.
    return GpuSpec{.name = "h200", .peak_tflops = 989, .hbm_tbps = 4.8, .nvlink_gbps = 450};
}

Result<ModelShape> model_by_name(std::string_view name) {
    if (name == "qwen3-32b") return qwen3_32b();
    if (name == "tiny") return tiny_test_model();
    return invalid_argument(fmt::format("unknown model shape '{}': use qwen3-32b or tiny", name));
}

Result<GpuSpec> gpu_by_name(std::string_view name) {
    if (name == "h200") return h200();
    return invalid_argument(fmt::format("unknown GPU '{}': use h200", name));
}

Result<CostModel> CostModel::create(ModelShape model, GpuSpec gpu, int tp, CostModelConfig config) {
    if (tp < 1) return invalid_argument(fmt::format("tp must be at least 1, got {}", tp));
    if (model.layers < 1 || model.hidden < 1 || model.head_dim < 1 || model.vocab < 1)
        return invalid_argument(fmt::format("model shape '{}' has an empty dimension", model.name));
    if (model.q_heads % tp != 0 || model.kv_heads % tp != 0)
        return invalid_argument(
            fmt::format("tp {} does not divide the {} query heads and {} KV heads of '{}': "
                        "pick a tp that divides both (tp {} works)",
                        tp, model.q_heads, model.kv_heads, model.name,
                        std::gcd(model.q_heads, model.kv_heads)));
    if (gpu.peak_tflops <= 0 || gpu.hbm_tbps <= 0)
        return invalid_argument(
            fmt::format("GPU '{}' needs positive peak and bandwidth", gpu.name));
    if (config.compute_efficiency <= 0 || config.compute_efficiency > 1 ||
        config.bandwidth_efficiency <= 0 || config.bandwidth_efficiency > 1)
        return invalid_argument(
            fmt::format("compute_efficiency and bandwidth_efficiency must lie in (0, 1], got {} "
                        "and {}",
                        config.compute_efficiency, config.bandwidth_efficiency));
    return CostModel(std::move(model), std::move(gpu), tp, config);
}

kv::KvLayout CostModel::kv_layout(uint32_t block_size, uint32_t num_blocks) const {
    kv::KvLayout l;
    l.num_layers = uint32_t(model_.layers);
    l.num_kv_heads = uint32_t(model_.kv_heads / tp_);
    l.head_dim = uint32_t(model_.head_dim);
    l.elem_size = uint32_t(model_.elem_bytes);
    l.block_size = block_size;
    l.num_blocks = num_blocks;
    l.placement = kv::KvPlacement::kBlockMajor;
    l.order = kv::BlockOrder::kNHD;
    return l;
}

CostModel::Roofline CostModel::finish(double flops, double bytes, double tokens) const {
    Roofline r;
    r.flops = flops / tp_;
    r.bytes = bytes / tp_;
    r.compute_s = r.flops / (gpu_.peak_tflops * 1e12 * config_.compute_efficiency);
    r.memory_s = r.bytes / (gpu_.hbm_tbps * 1e12 * config_.bandwidth_efficiency);
    if (tp_ > 1) {
        // Two ring all-reduces of the activations per layer (after attention and after MLP).
        double ar_bytes = tokens * model_.hidden * model_.elem_bytes;
        double per_ar = 2.0 * (tp_ - 1) / tp_ * ar_bytes / (gpu_.nvlink_gbps * 1e9) +
                        config_.allreduce_latency_us * 1e-6;
        r.comm_s = 2.0 * model_.layers * per_ar;
    }
    r.total_s = std::max(r.compute_s, r.memory_s) + r.comm_s + config_.step_overhead_us * 1e-6;
    return r;
}

CostModel::Roofline CostModel::prefill_roofline(std::span<const int> prompt_lens) const {
    std::vector<PrefillChunk> chunks;
    chunks.reserve(prompt_lens.size());
    for (int n : prompt_lens) chunks.push_back({.tokens = n, .context = 0, .last = true});
    return prefill_roofline(chunks);
}

CostModel::Roofline CostModel::prefill_roofline(std::span<const PrefillChunk> chunks) const {
    const double lm_head = double(model_.hidden) * model_.vocab;
    const double per_token = model_.matmul_params() - lm_head;
    const double attn_unit = 4.0 * model_.layers * model_.q_heads * model_.head_dim;
    double flops = 0, tokens = 0, context_read = 0;
    for (const PrefillChunk& c : chunks) {
        double len = c.tokens, ctx = c.context;
        tokens += len;
        // Linear part: every token through every matmul; LM head only for the prompt's last
        // token.
        flops += 2.0 * per_token * len + (c.last ? 2.0 * lm_head : 0.0);
        // Causal attention: token i (counted from the prompt's start) attends to i + 1 keys in
        // QK^T and in AV; this chunk's tokens are ctx .. ctx + len - 1.
        flops += attn_unit * (len * ctx + len * (len + 1) / 2);
        context_read += ctx;
    }
    // Weights once per step; the new tokens' KV written; the context's KV read.
    double bytes = model_.weight_bytes() + (tokens + context_read) * model_.kv_bytes_per_token();
    return finish(flops, bytes, tokens);
}

CostModel::Roofline CostModel::decode_roofline(std::span<const int> context_lens) const {
    const double attn_unit = 4.0 * model_.layers * model_.q_heads * model_.head_dim;
    double batch = double(context_lens.size());
    double flops = 2.0 * model_.matmul_params() * batch;
    double kv_read = 0;
    for (int ctx : context_lens) {
        flops += attn_unit * ctx;
        kv_read += double(ctx) * model_.kv_bytes_per_token();
    }
    // Every step streams all weights and every sequence's KV from HBM, and writes one KV row.
    double bytes = model_.weight_bytes() + kv_read + batch * model_.kv_bytes_per_token();
    return finish(flops, bytes, batch);
}

double CostModel::prefill_seconds(std::span<const int> prompt_lens) const {
    if (prompt_lens.empty()) return 0;
    return prefill_roofline(prompt_lens).total_s;
}

double CostModel::prefill_seconds(std::span<const PrefillChunk> chunks) const {
    if (chunks.empty()) return 0;
    return prefill_roofline(chunks).total_s;
}

double CostModel::decode_seconds(std::span<const int> context_lens) const {
    if (context_lens.empty()) return 0;
    return decode_roofline(context_lens).total_s;
}

}  // namespace ferry::serve
