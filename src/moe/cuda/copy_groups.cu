// Grouped batch <-> padded per-expert slabs (cuda_copy_groups in cuda_all_to_all.h): the
// layout change between ferry's grouped batch and the [experts, capacity, hidden] tensors of
// pplx-garden's and DeepEP's Python calls. Group sizes are read from device memory so that a
// captured graph copies whatever each call produced.
#include "moe/cuda/kernels.h"

namespace ferry::moe::cuda {
namespace {

constexpr uint32_t kThreads = 256;
constexpr uint32_t kBlocksPerExpert = 8;

// blockIdx.y is the expert; the blocks of an expert stride over its rows' words.
template <typename Word>
__global__ void copy_groups_kernel(const uint8_t* grouped_in, uint8_t* grouped_out,
                                   const uint8_t* padded_in, uint8_t* padded_out,
                                   const uint32_t* offsets, uint64_t row_words, uint32_t capacity) {
    const uint32_t e = blockIdx.y;
    const uint32_t begin = offsets[e];
    const uint32_t end = offsets[e + 1];
    const uint64_t rows = end > begin ? min(end - begin, capacity) : 0u;
    const uint64_t total = rows * row_words;
    const uint64_t g = uint64_t{begin} * row_words;         // first word of the group
    const uint64_t p = uint64_t{e} * capacity * row_words;  // first word of the slab
    for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total;
         i += uint64_t{gridDim.x} * blockDim.x) {
        if (padded_out) {
            reinterpret_cast<Word*>(padded_out)[p + i] =
                reinterpret_cast<const Word*>(grouped_in)[g + i];
        } else {
            reinterpret_cast<Word*>(grouped_out)[g + i] =
                reinterpret_cast<const Word*>(padded_in)[p + i];
        }
    }
}

template <typename Word>
cudaError_t launch(const void* grouped, void* padded, const uint32_t* offsets, uint32_t experts,
                   uint64_t row_bytes, uint32_t capacity, bool to_padded, cudaStream_t stream) {
    const uint64_t words = row_bytes / sizeof(Word);
    dim3 grid(kBlocksPerExpert, experts);
    auto* g = static_cast<uint8_t*>(const_cast<void*>(grouped));
    auto* pd = static_cast<uint8_t*>(padded);
    if (to_padded) {
        copy_groups_kernel<Word>
            <<<grid, kThreads, 0, stream>>>(g, nullptr, nullptr, pd, offsets, words, capacity);
    } else {
        copy_groups_kernel<Word>
            <<<grid, kThreads, 0, stream>>>(nullptr, g, pd, nullptr, offsets, words, capacity);
    }
    return cudaGetLastError();
}

}  // namespace

cudaError_t launch_copy_groups(const void* grouped, void* padded, const uint32_t* offsets,
                               uint32_t experts, uint64_t row_bytes, uint32_t capacity,
                               bool to_padded, cudaStream_t stream) {
    if (experts > 65535) return cudaErrorInvalidValue;  // grid.y
    const auto a = reinterpret_cast<uintptr_t>(grouped) | reinterpret_cast<uintptr_t>(padded);
    if (row_bytes % 16 == 0 && a % 16 == 0)
        return launch<int4>(grouped, padded, offsets, experts, row_bytes, capacity, to_padded,
                            stream);
    if (row_bytes % 4 == 0 && a % 4 == 0)
        return launch<uint32_t>(grouped, padded, offsets, experts, row_bytes, capacity, to_padded,
                                stream);
    return launch<uint8_t>(grouped, padded, offsets, experts, row_bytes, capacity, to_padded,
                           stream);
}

}  // namespace ferry::moe::cuda
