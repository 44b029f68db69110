// Builds without CUDA: `ferry bench moe --backend cuda` says why it cannot run.
#include "bench/moe_internal.h"

#ifndef FERRY_HAVE_CUDA
namespace ferry::moe::bench_detail {
Status run_cuda_ranks(const MoeBenchConfig&, const AllToAllConfig&, std::vector<RankResult>*) {
    return unavailable(
        "bench moe --backend cuda: this build of ferry has no CUDA support (nvcc was not found "
        "at build time); use --backend cpu");
}
}  // namespace ferry::moe::bench_detail
#endif
