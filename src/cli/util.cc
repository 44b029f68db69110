#include "cli/util.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "cli/commands.h"

namespace ferry::cli {

void fail(const Status& s) {
    std::fprintf(stderr, "ferry: %s\n", s.to_string().c_str());
    set_exit_code(1);
}

// A regular file is written beside itself and renamed over its name: a failed write (a full
// disk) left a truncated file under the result's name, and a later step of a sweep read it as a
// result. A symlink is followed first, and what is not a regular file (/dev/stdout, a FIFO) is
// written in place: the rename replaced a symlink or a FIFO with a file (and, as root,
// `--json /dev/stdout` would have replaced /dev/stdout for every process of the host).
Status write_json_file(const std::string& path, const nlohmann::json& j) {
    const std::string text = j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    std::error_code ec;
    const auto kind = std::filesystem::status(path, ec).type();
    const bool special = !ec && kind != std::filesystem::file_type::not_found &&
                         kind != std::filesystem::file_type::regular;
    std::string target = path;
    if (!special && std::filesystem::is_symlink(path, ec)) {
        auto resolved = std::filesystem::weakly_canonical(path, ec);
        if (!ec) target = resolved.string();
    }
    if (special) {
        std::ofstream f(path);
        if (!f)
            return invalid_argument(fmt::format("cannot write {}: {}", path, std::strerror(errno)));
        f << text;
        f.close();
        return f ? ok_status() : unavailable("writing " + path + " failed");
    }
    const std::string tmp = fmt::format("{}.tmp{}", target, ::getpid());
    Status st = ok_status();
    {
        std::ofstream f(tmp);
        if (!f)
            return invalid_argument(fmt::format("cannot write {}: {}", path, std::strerror(errno)));
        f << text;
        f.close();
        if (!f) st = unavailable("writing " + path + " failed");
    }
    if (st.ok() && std::rename(tmp.c_str(), target.c_str()) != 0)
        st = unavailable(fmt::format("cannot write {}: {}", path, std::strerror(errno)));
    if (!st.ok()) std::remove(tmp.c_str());
    return st;
}

}  // namespace ferry::cli
