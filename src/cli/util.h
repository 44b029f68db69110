// Small helpers shared by the subcommands.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "ferry/common/status.h"

namespace ferry::cli {

// Prints "ferry: <error>" and sets a failing exit status.
void fail(const Status& s);
Status write_json_file(const std::string& path, const nlohmann::json& j);

}  // namespace ferry::cli
