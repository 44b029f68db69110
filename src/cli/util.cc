#include "cli/util.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "cli/commands.h"

namespace ferry::cli {

void fail(const Status& s) {
    std::fprintf(stderr, "ferry: %s\n", s.to_string().c_str());
    set_exit_code(1);
}

// Written beside `path` and renamed over it: a failed write (a full disk) left a truncated file
// under the result's name, and a later step of a sweep read it as a result.
Status write_json_file(const std::string& path, const nlohmann::json& j) {
    const std::string tmp = fmt::format("{}.tmp{}", path, ::getpid());
    Status st = ok_status();
    {
        std::ofstream f(tmp);
        if (!f)
            return invalid_argument(fmt::format("cannot write {}: {}", path, std::strerror(errno)));
        f << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
        f.close();
        if (!f) st = unavailable("writing " + path + " failed");
    }
    if (st.ok() && std::rename(tmp.c_str(), path.c_str()) != 0)
        st = unavailable(fmt::format("cannot write {}: {}", path, std::strerror(errno)));
    if (!st.ok()) std::remove(tmp.c_str());
    return st;
}

}  // namespace ferry::cli
