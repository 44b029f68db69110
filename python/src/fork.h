// What a process that forked hands its child: copies of ferry's objects whose threads stayed in
// the parent, and of the mutexes and condition variables those threads held or waited on, frozen
// mid-use. A child that exited after os.fork() (sys.exit, or its garbage collector) destroyed the
// engine it inherited and hung in pthread_cond_destroy, or crashed joining a thread it does not
// have, though it never used ferry. So each object that owns native state stamps the process
// generation it was made in, and destroyed in a later one (a fork child) it leaks that state
// instead: the child's copy of the memory goes when the child exits, and the parent's engine is
// untouched. Objects a child makes for itself are its own and are destroyed as usual.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace ferry::python {

// 0 in the process that imported ferry, one more in each fork() child (pthread_atfork).
inline std::atomic<uint64_t> fork_generation{0};

// Installs the handler that counts forks; once, when the module is imported.
inline void count_forks() {
    static const bool installed = [] {
        ::pthread_atfork(nullptr, nullptr,
                         [] { fork_generation.fetch_add(1, std::memory_order_relaxed); });
        return true;
    }();
    (void)installed;
}

// The process generation an object was made in.
class MadeIn {
  public:
    // True in a fork child of the process that made the object: it belongs to the parent.
    bool inherited() const {
        return generation_ != fork_generation.load(std::memory_order_relaxed);
    }

  private:
    uint64_t generation_ = fork_generation.load(std::memory_order_relaxed);
};

// Never destroys `x` (what an inherited object owns).
template <typename T>
void abandon(T&& x) {
    new std::decay_t<T>(std::forward<T>(x));  // NOLINT(cppcoreguidelines-owning-memory)
}

}  // namespace ferry::python
