// Roofline cost model of an LLM forward step. ferry does not run a neural network: the compute
// of prefill and decode is *modelled* (the engine sleeps for the time computed here), while the
// KV bytes the model would produce are real and really move between engines. Every constant
// lives in ModelShape / GpuSpec / CostModelConfig so a measured engine can calibrate them.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "ferry/common/status.h"
#include "ferry/kv/layout.h"

namespace ferry::serve {

// A dense decoder-only transformer with grouped-query attention and a gated MLP.
struct ModelShape {
    std::string name;
    int layers = 0;
    int hidden = 0;
    int q_heads = 0;
    int kv_heads = 0;
    int head_dim = 0;
    int intermediate = 0;
    int vocab = 0;
    int elem_bytes = 2;  // bf16 weights, activations and KV

    // Parameters of the matmuls one token passes through, all layers, without the embedding
    // lookup (which is a gather, not a matmul) but with the LM head.
    double matmul_params() const;
    double weight_bytes() const;  // all parameters incl. the embedding table
    // KV bytes one token adds to the cache, all layers, all KV heads (before TP split).
    double kv_bytes_per_token() const;
};

struct GpuSpec {
    std::string name;
    double peak_tflops = 0;  // dense bf16 tensor-core peak
    double hbm_tbps = 0;     // HBM bandwidth, TB/s
    double nvlink_gbps = 0;  // per-GPU NVLink bandwidth one way, GB/s (for TP all-reduce)
};

// Achieved fractions of peak and fixed costs. Defaults are typical of vLLM on Hopper: large
// prefill GEMMs reach ~60% of peak, decode streams weights and KV at ~80% of HBM bandwidth.
struct CostModelConfig {
    double compute_efficiency = 0.6;
    double bandwidth_efficiency = 0.8;
    double step_overhead_us = 300;    // scheduler, kernel launches, sampling per step
    double allreduce_latency_us = 8;  // per all-reduce, two per layer at TP > 1
};

// The shapes and GPUs ferry knows by name.
ModelShape qwen3_32b();
// A few-KiB-per-token shape for fast tests: 2 layers, 2 KV heads of 16, vocab 1000.
ModelShape tiny_test_model();
GpuSpec h200();
Result<ModelShape> model_by_name(std::string_view name);  // "qwen3-32b", "tiny"
Result<GpuSpec> gpu_by_name(std::string_view name);       // "h200"

// One prompt's part of a prefill step: `tokens` new tokens after `context` tokens whose KV is
// already in the cache (chunked prefill). `last`: the prompt ends with this chunk, so the LM
// head runs for its final token.
struct PrefillChunk {
    int tokens = 0;
    int context = 0;
    bool last = true;
};

class CostModel {
  public:
    // TP must divide the query and KV heads (as vLLM requires, KV heads replicate beyond that
    // is not modelled).
    static Result<CostModel> create(ModelShape model, GpuSpec gpu, int tp,
                                    CostModelConfig config = {});

    const ModelShape& model() const { return model_; }
    const GpuSpec& gpu() const { return gpu_; }
    int tp() const { return tp_; }
    const CostModelConfig& config() const { return config_; }

    // The KV pool of one tensor-parallel rank of this model: its share of the KV heads,
    // `num_blocks` blocks of `block_size` tokens, block-major (serve's KvPool).
    kv::KvLayout kv_layout(uint32_t block_size, uint32_t num_blocks) const;

    // One prefill step processing whole prompts of these lengths (no chunking), seconds.
    double prefill_seconds(std::span<const int> prompt_lens) const;
    // One prefill step of chunks (chunked prefill). Each step re-reads the weights and pays
    // the step overhead and the all-reduce latencies again; a chunk attends to its context
    // (read from HBM) and causally within itself.
    double prefill_seconds(std::span<const PrefillChunk> chunks) const;
    // One decode step producing one token for each sequence with these context lengths.
    double decode_seconds(std::span<const int> context_lens) const;

    // The two roofline terms, exposed so tests and docs can show which one binds.
    struct Roofline {
        double flops = 0;  // per GPU
        double bytes = 0;  // HBM traffic per GPU
        double compute_s = 0;
        double memory_s = 0;
        double comm_s = 0;
        double total_s = 0;
    };
    Roofline prefill_roofline(std::span<const int> prompt_lens) const;
    Roofline prefill_roofline(std::span<const PrefillChunk> chunks) const;
    Roofline decode_roofline(std::span<const int> context_lens) const;

  private:
    CostModel(ModelShape model, GpuSpec gpu, int tp, CostModelConfig config)
        : model_(std::move(model)), gpu_(std::move(gpu)), tp_(tp), config_(config) {}
    Roofline finish(double flops, double bytes, double tokens) const;

    ModelShape model_;
    GpuSpec gpu_;
    int tp_ = 1;
    CostModelConfig config_;
};

}  // namespace ferry::serve
