#include "cli/util.h"

#include <cstdio>
#include <fstream>

#include "cli/commands.h"

namespace ferry::cli {

void fail(const Status& s) {
    std::fprintf(stderr, "ferry: %s\n", s.to_string().c_str());
    set_exit_code(1);
}

Status write_json_file(const std::string& path, const nlohmann::json& j) {
    std::ofstream f(path);
    if (!f) return invalid_argument("cannot write " + path);
    f << j.dump(2) << "\n";
    return f ? ok_status() : unavailable("writing " + path + " failed");
}

}  // namespace ferry::cli
