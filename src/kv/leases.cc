#include "leases.h"

namespace ferry::kv::detail {

void Leases::sweep(TimePoint now) {
    sender_.expire(now);
    receiver_.expire(now);
    server_.expire(now);
    puller_.expire(now);
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
