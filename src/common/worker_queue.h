// One worker thread that runs posted jobs in the order they came: the queue a class uses to
// move work off its caller's thread, instead of its own mutex, condition variable and deque.
// A job runs without the queue's lock held, so it may post more jobs.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace ferry {

class WorkerQueue {
  public:
    using Job = std::function<void()>;
    // What stop() does with jobs still queued.
    enum class AtStop {
        kRunQueued,   // runs them before the thread ends
        kDropQueued,  // destroys them unrun (the job in progress still finishes)
    };
    struct Options {
        std::string thread_name = "ferry-worker";  // at most 15 characters show
        size_t capacity = SIZE_MAX;                // post() refuses a job beyond this many queued
        AtStop at_stop = AtStop::kRunQueued;
    };

    explicit WorkerQueue(Options options);  // starts the thread
    ~WorkerQueue();                         // stop()
    WorkerQueue(const WorkerQueue&) = delete;
    WorkerQueue& operator=(const WorkerQueue&) = delete;

    // False (the job is destroyed unrun) once stop() began or when `capacity` jobs wait.
    bool post(Job job);
    // Refuses new jobs, runs or drops the queued ones (Options::at_stop), joins the thread.
    // Idempotent; never call it from a job (the thread cannot join itself).
    void stop();
    size_t queued() const;

  private:
    void run();

    const Options options_;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Job> jobs_;
    bool stopping_ = false;
    std::thread thread_;
};

}  // namespace ferry
