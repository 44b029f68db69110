#include "ferry/common/bytes.h"

#include <fmt/format.h>

namespace ferry {

Status ByteReader::truncated(std::string_view field, size_t need) const {
    return protocol_error(
        fmt::format("truncated message: field '{}' needs {} bytes at offset {}, "
                    "only {} left",
                    field, need, pos_, remaining()));
}

Status ByteReader::count_too_large(std::string_view field, size_t n, size_t max) {
    return protocol_error(
        fmt::format("malformed message: field '{}' claims {} entries, limit is {}", field, n, max));
}

Status ByteReader::get_bytes(std::vector<uint8_t>* out, std::string_view field, size_t max_len) {
    return get_vector(out, field, max_len);
}

Status ByteReader::get_string(std::string* out, std::string_view field, size_t max_len) {
    std::vector<uint8_t> b;
    FERRY_RETURN_IF_ERROR(get_vector(&b, field, max_len));
    out->assign(b.begin(), b.end());
    return ok_status();
}

}  // namespace ferry
