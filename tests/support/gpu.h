// GPU test helpers: tests that need a GPU skip with a printed reason where none is visible.
#pragma once

#include <string>

namespace ferry::testing {

// Number of visible CUDA devices; 0 in builds without CUDA or on hosts without a GPU.
int gpu_count();
// Why GPU tests skip here, for GTEST_SKIP.
std::string no_gpu_reason();

}  // namespace ferry::testing
