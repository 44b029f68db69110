// Names the calling thread (at most 15 characters show), so `top -H`, a debugger and
// /proc/PID/task/*/comm tell ferry's threads apart: a rail's worker, the KV connector, an
// engine's step loop ...
#pragma once

namespace ferry {

void set_thread_name(const char* name);

}  // namespace ferry
