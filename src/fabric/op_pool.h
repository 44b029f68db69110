// Recycled storage for the per-operation objects that one thread allocates and another frees
// (a FabricOp and an OpState are made by the submitting thread and freed by a rail's worker).
// With plain malloc every such free lands in the allocating thread's arena, under its lock, so
// the submitter and the worker took turns on the arena's cache lines for every operation.
// Here a freeing thread gathers blocks in a list of its own and hands them back kChain at a
// time with one atomic push; an allocating thread takes everything handed back with one
// atomic exchange and then pops from its own list. Measured on the 16-core host (shm, single
// 64 B writes, `ferry bench xfer --repeat 3 --seconds 0.2`, 2026-12-02, one build): 433k
// writes/s (0.52x of the raw loop) with malloc, 564k (0.80x) with the pool.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>

namespace ferry::detail {

template <size_t Size, size_t Align>
class OpPool {
  public:
    static void* allocate() {
#if defined(__SANITIZE_ADDRESS__)
        return ::operator new(Size, std::align_val_t(Align));
#else
        Local& l = local();
        if (!l.ready) l.next_chain();
        if (Node* n = l.ready) {
            l.ready = n->next;
            return n;
        }
        return ::operator new(Size, std::align_val_t(Align));
#endif
    }

    static void release(void* p) {
#if defined(__SANITIZE_ADDRESS__)
        ::operator delete(p, std::align_val_t(Align));
#else
        Local& l = local();
        auto* n = static_cast<Node*>(p);
        n->next = l.freed;
        if (!l.freed) l.freed_tail = n;
        l.freed = n;
        if (++l.nfreed == kChain) l.flush();
#endif
    }

  private:
    static_assert(Size >= 2 * sizeof(void*), "a pooled block holds two links");
    // Chains of 64: one atomic push per 64 frees and one exchange per batch of allocations.
    static constexpr size_t kChain = 64;
    // At most this many blocks wait in the shared stack: a KV transfer's paged write of 131,072
    // pages (32 MiB of FabricOps) finds its operations here the next time. With 1024, the rest
    // of such a burst went back to malloc and was allocated again (and its pages faulted in)
    // on every transfer: 88-389 ns per page in the paged_write call against 65-186 ns with this
    // bound (131,072 and 16,384 random 4 KiB pages over shm, best of 5, three alternating runs,
    // 2-core dev VM under load 19-21, 2026-12-07).
    static constexpr size_t kMaxPooled = size_t{1} << 17;

    struct Node {
        Node* next;        // next block of this chain (or of a thread's list)
        Node* next_chain;  // in the shared stack, on a chain's first block: the next chain
    };

    static void free_list(Node* n) {
        while (n) {
            Node* next = n->next;
            ::operator delete(n, std::align_val_t(Align));
            n = next;
        }
    }

    struct Shared {
        std::atomic<Node*> chains{nullptr};
        std::atomic<size_t> pooled{0};  // blocks in chains (approximate: updated per chain)
    };
    static Shared& shared() {
        static Shared s;
        return s;
    }

    // Pushes one chain of kChain blocks, or frees it when the stack is full.
    static void push_chain(Node* first, Node* last) {
        Shared& s = shared();
        if (s.pooled.load(std::memory_order_relaxed) >= kMaxPooled) {
            last->next = nullptr;
            free_list(first);
            return;
        }
        s.pooled.fetch_add(kChain, std::memory_order_relaxed);
        last->next = nullptr;
        Node* head = s.chains.load(std::memory_order_relaxed);
        do {
            first->next_chain = head;
        } while (!s.chains.compare_exchange_weak(head, first, std::memory_order_release,
                                                 std::memory_order_relaxed));
    }

    // Takes every chain handed back (the whole stack at once: no ABA), still as chains: the
    // allocating thread moves on to the next chain when one is used up. Linking them into one
    // list walked every block, ~8 of the submitting thread's instructions per 64 B write
    // (callgrind, shm, 2026-12-03).
    static Node* take_all() {
        Shared& s = shared();
        Node* c = s.chains.exchange(nullptr, std::memory_order_acquire);
        size_t n = 0;
        for (Node* k = c; k; k = k->next_chain) n += kChain;
        if (n) s.pooled.fetch_sub(n, std::memory_order_relaxed);
        return c;
    }

    struct Local {
        Node* ready = nullptr;   // the chain allocated from
        Node* chains = nullptr;  // taken from the shared stack, linked by next_chain
        Node* freed = nullptr;   // freed here, until a chain is full
        Node* freed_tail = nullptr;
        size_t nfreed = 0;
        // Moves on to the next chain taken (taking the shared stack when none is left).
        void next_chain() {
            if (!chains) chains = take_all();
            ready = chains;
            if (chains) chains = chains->next_chain;
        }
        void flush() {
            push_chain(freed, freed_tail);
            freed = freed_tail = nullptr;
            nfreed = 0;
        }
        ~Local() {
            free_list(ready);
            for (Node* c = chains; c;) {
                Node* next = c->next_chain;
                free_list(c);
                c = next;
            }
            if (freed) freed_tail->next = nullptr;
            free_list(freed);
        }
    };
    static Local& local() {
        thread_local Local l;
        return l;
    }
};

// A std::allocator for std::allocate_shared over OpPool (one block per object).
template <typename T>
struct PoolAllocator {
    using value_type = T;
    // Whole cache lines: the block moves between the submitting thread's core and the worker's.
    static constexpr size_t kAlign = alignof(T) > 64 ? alignof(T) : 64;
    PoolAllocator() = default;
    template <typename U>
    PoolAllocator(const PoolAllocator<U>&) {}
    T* allocate(size_t n) {
        if (n != 1) return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(kAlign)));
        return static_cast<T*>(OpPool<sizeof(T), kAlign>::allocate());
    }
    void deallocate(T* p, size_t n) {
        if (n != 1) {
            ::operator delete(p, std::align_val_t(kAlign));
            return;
        }
        OpPool<sizeof(T), kAlign>::release(p);
    }
    template <typename U>
    bool operator==(const PoolAllocator<U>&) const {
        return true;
    }
};

}  // namespace ferry::detail
