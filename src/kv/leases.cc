#include "leases.h"

namespace ferry::kv::detail {

void Leases::sweep(TimePoint now) {
    sender_.expire(now);
    receiver_.expire(now);
    server_.expire(now);
    puller_.expire(now);
}

void Leases::engine_failed(const Status& why, TimePoint now) {
    // Prefill's writes into this side's blocks need this engine's rail on shm and tcp (the
    // provider copies at the target): once it is lost, nothing lands, and the waiting
    // registrations end after op_timeout and a second, when every write prefill posted into
    // them has failed at its end too. Where prefill can write without this engine (cma_writes,
    // or through another rail), its writes may still come until its lease: they keep theirs.
    const EngineConfig& ec = ctx_.engine->config();
    const bool written_without_us = ec.cma_writes || ctx_.engine->num_rails() > 1;
    const TimePoint at =
        now + (written_without_us ? ctx_.cfg.lease : ec.op_timeout + std::chrono::seconds(1));
    receiver_.engine_failed(why, at);
    // Pulls still asking prefill for its offer: the answer cannot come.
    puller_.report_shut_down(why);
}

void Leases::begin_shutdown() {
    stopping_ = true;
    shutdown_deadline_ = Clock::now() + ctx_.engine->config().op_timeout + std::chrono::seconds(1);
    sender_.begin_shutdown();
    receiver_.begin_shutdown();
}

bool Leases::shut_down(TimePoint now) const {
    return stopping_ && (ctx_.flights_open.load() == 0 || now > shutdown_deadline_);
}

void Leases::report_all_as_shut_down() {
    Status s = cancelled("the KV connector was shut down");
    sender_.report_shut_down(s);
    receiver_.report_shut_down(s);
    server_.report_shut_down(s);
    puller_.report_shut_down(s);
}

}  // namespace ferry::kv::detail
