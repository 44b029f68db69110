// What the serving library's messages call one of its settings.
//
// The library speaks of its own settings by their field names (HttpServerOptions::queue_timeout
// is "queue_timeout"). A program that sets them from flags gives its own names for them, so that
// an answer sent to an HTTP client, or a log line, says what an operator changes: `ferry serve`
// names its flags (src/cli/setting_flags.cc). Messages returned while a component is created are
// translated by the caller instead (cli::in_flag_names), as nothing else has seen them yet.
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace ferry::serve {

// Maps a setting's field name to what the operator calls it; empty: the field name itself.
using SettingNames = std::function<std::string(std::string_view setting)>;

inline std::string setting_name(const SettingNames& names, std::string_view setting) {
    return names ? names(setting) : std::string(setting);
}

}  // namespace ferry::serve
