// Little-endian binary encoding for descriptors and protocol messages. Reading is bounds
// checked: a truncated or malformed blob gives a protocol error naming the field, never a
// read past the end.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "ferry/common/status.h"

namespace ferry {

class ByteWriter {
  public:
    template <typename T>
    requires std::is_trivially_copyable_v<T>
    void put(T v) {
        size_t at = buf_.size();
        buf_.resize(at + sizeof(T));
        std::memcpy(buf_.data() + at, &v, sizeof(T));
    }
    void put_bytes(std::span<const uint8_t> b) {
        put<uint32_t>(static_cast<uint32_t>(b.size()));
        buf_.insert(buf_.end(), b.begin(), b.end());
    }
    void put_string(std::string_view s) {
        put_bytes({reinterpret_cast<const uint8_t*>(s.data()), s.size()});
    }
    template <typename T>
    requires std::is_trivially_copyable_v<T>
    void put_vector(const std::vector<T>& v) {
        put<uint32_t>(static_cast<uint32_t>(v.size()));
        size_t at = buf_.size();
        buf_.resize(at + v.size() * sizeof(T));
        if (!v.empty()) std::memcpy(buf_.data() + at, v.data(), v.size() * sizeof(T));
    }

    std::vector<uint8_t>& bytes() { return buf_; }
    std::vector<uint8_t> take() { return std::move(buf_); }

  private:
    std::vector<uint8_t> buf_;
};

class ByteReader {
  public:
    explicit ByteReader(std::span<const uint8_t> data) : data_(data) {}

    template <typename T>
    requires std::is_trivially_copyable_v<T> Status get(T* out, std::string_view field) {
        if (remaining() < sizeof(T)) return truncated(field, sizeof(T));
        std::memcpy(out, data_.data() + pos_, sizeof(T));
        pos_ += sizeof(T);
        return ok_status();
    }
    Status get_bytes(std::vector<uint8_t>* out, std::string_view field, size_t max_len);
    Status get_string(std::string* out, std::string_view field, size_t max_len);
    template <typename T>
    requires std::is_trivially_copyable_v<T> Status get_vector(std::vector<T>* out,
                                                               std::string_view field,
                                                               size_t max_count) {
        uint32_t n = 0;
        FERRY_RETURN_IF_ERROR(get(&n, field));
        if (n > max_count) return count_too_large(field, n, max_count);
        if (remaining() < size_t{n} * sizeof(T)) return truncated(field, size_t{n} * sizeof(T));
        out->resize(n);
        if (n) std::memcpy(out->data(), data_.data() + pos_, size_t{n} * sizeof(T));
        pos_ += size_t{n} * sizeof(T);
        return ok_status();
    }

    size_t remaining() const { return data_.size() - pos_; }
    size_t position() const { return pos_; }

  private:
    Status truncated(std::string_view field, size_t need) const;
    static Status count_too_large(std::string_view field, size_t n, size_t max);

    std::span<const uint8_t> data_;
    size_t pos_ = 0;
};

}  // namespace ferry
