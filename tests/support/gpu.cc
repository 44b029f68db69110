#include "support/gpu.h"

#include <sys/wait.h>
#include <unistd.h>

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace ferry::testing {

// CUDA must not be initialised in the test process itself: children forked after that
// cannot use the GPU ("initialization error"). So ask in a throwaway child.
int gpu_count() {
#ifdef FERRY_HAVE_CUDA
    static int count = [] {
        pid_t pid = fork();
        if (pid == 0) {
            int n = 0;
            if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
            _exit(n > 100 ? 100 : n);
        }
        int status = 0;
        if (pid < 0 || waitpid(pid, &status, 0) < 0 || !WIFEXITED(status)) return 0;
        return WEXITSTATUS(status);
    }();
    return count;
#else
    return 0;
#endif
}

std::string no_gpu_reason() {
#ifdef FERRY_HAVE_CUDA
    return "no usable GPU visible to the CUDA runtime here";
#else
    return "built without CUDA";
#endif
}

}  // namespace ferry::testing
