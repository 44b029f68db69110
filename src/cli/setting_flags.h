// The serving library's settings and the flags of `ferry serve` that set them: one table, used
// both for errors returned while a component is created and for the names the running
// components put in their answers (serve/setting_names.h).
#pragma once

#include <string_view>

#include "ferry/common/status.h"
#include "serve/setting_names.h"

namespace ferry::cli {

// The flag that sets each setting. Two depend on the component: an HTTP server's `port` is
// --port, or --prefill-port/--decode-port for the engines of `serve local`, and its `threads`
// --http-threads on an engine, --router-threads on a router.
serve::SettingNames flag_names(std::string_view port_flag = "--port",
                               std::string_view threads_flag = "--http-threads");

// `s` with each setting's name (a whole word) put in its flag's name.
Status in_flag_names(const Status& s);

}  // namespace ferry::cli
