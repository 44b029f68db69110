// Intrusive multi-producer single-consumer queue (Vyukov). Producers never block or lock:
// a push is one atomic exchange, and a whole batch is pushed with one exchange too, so the
// worker sees a batch together and can post it with FI_MORE.
#pragma once

#include <atomic>

namespace ferry::detail {

struct MpscNode {
    std::atomic<MpscNode*> mpsc_next{nullptr};
};

class MpscQueue {
  public:
    MpscQueue() : head_(&stub_), tail_(&stub_) {}
    MpscQueue(const MpscQueue&) = delete;
    MpscQueue& operator=(const MpscQueue&) = delete;

    // Pushes a chain first -> ... -> last already linked through mpsc_next.
    void push_chain(MpscNode* first, MpscNode* last) {
        last->mpsc_next.store(nullptr, std::memory_order_relaxed);
        MpscNode* prev = head_.exchange(last, std::memory_order_acq_rel);
        prev->mpsc_next.store(first, std::memory_order_release);
    }
    void push(MpscNode* n) { push_chain(n, n); }

    // Consumer only. Returns nullptr when empty (or when a producer is mid-push; the item
    // shows up on a later call).
    MpscNode* pop() {
        MpscNode* tail = tail_;
        MpscNode* next = tail->mpsc_next.load(std::memory_order_acquire);
        if (tail == &stub_) {
            if (!next) return nullptr;
            tail_ = next;
            tail = next;
            next = next->mpsc_next.load(std::memory_order_acquire);
        }
        if (next) {
            tail_ = next;
            return tail;
        }
        if (tail != head_.load(std::memory_order_acquire)) return nullptr;
        push(&stub_);
        next = tail->mpsc_next.load(std::memory_order_acquire);
        if (next) {
            tail_ = next;
            return tail;
        }
        return nullptr;
    }

    bool empty_hint() const {
        return tail_ == &stub_ ? stub_.mpsc_next.load(std::memory_order_acquire) == nullptr : false;
    }

  private:
    alignas(64) std::atomic<MpscNode*> head_;
    alignas(64) MpscNode* tail_;
    MpscNode stub_;
};

}  // namespace ferry::detail
