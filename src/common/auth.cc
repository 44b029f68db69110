#include "ferry/common/auth.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ferry {
namespace {

// Owns a file descriptor.
struct FileFd {
    int fd = -1;
    explicit FileFd(int f) : fd(f) {}
    ~FileFd() {
        if (fd >= 0) ::close(fd);
    }
    FileFd(const FileFd&) = delete;
    FileFd& operator=(const FileFd&) = delete;
};

Status errno_status(const std::string& what) {
    int e = errno;
    std::string m = fmt::format("{}: {}", what, strerror(e));
    if (e == EACCES || e == EPERM) return permission_denied(m);
    return unavailable(m);
}

// mkdir -p with mode 0700 for the folders it creates.
Status make_parent_dirs(const std::string& path) {
    for (size_t at = path.find('/', 1); at != std::string::npos; at = path.find('/', at + 1)) {
        std::string dir = path.substr(0, at);
        if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
            return errno_status(fmt::format("secret file {}: cannot create folder {}", path, dir));
    }
    return ok_status();
}

}  // namespace

Secret::~Secret() {
    if (!key_.empty()) OPENSSL_cleanse(key_.data(), key_.size());
}

Result<Secret> Secret::from_bytes(std::span<const uint8_t> bytes) {
    if (bytes.size() < kMinBytes)
        return invalid_argument(
            fmt::format("a secret needs at least {} bytes, got {}", kMinBytes, bytes.size()));
    if (bytes.size() > kMaxBytes)
        return invalid_argument(
            fmt::format("a secret may hold at most {} bytes, got {}", kMaxBytes, bytes.size()));
    Secret s;
    s.key_.assign(bytes.begin(), bytes.end());
    return s;
}

Result<Secret> Secret::generate() {
    std::array<uint8_t, kGeneratedBytes> b{};
    FERRY_RETURN_IF_ERROR(random_bytes(b));
    auto s = from_bytes(b);
    OPENSSL_cleanse(b.data(), b.size());
    return s;
}

Digest hmac_sha256(const Secret& key, std::span<const uint8_t> message) {
    Digest out{};
    unsigned int len = 0;
    auto k = key.bytes();
    // One-shot HMAC(): stable across OpenSSL 1.1 and 3.x (HMAC_CTX is deprecated
    // in 3.0).
    ::HMAC(EVP_sha256(), k.data(), int(k.size()), message.data(), message.size(), out.data(), &len);
    return out;
}

Digest sha256(std::span<const uint8_t> message) {
    Digest out{};
    unsigned int len = 0;
    ::EVP_Digest(message.data(), message.size(), out.data(), &len, EVP_sha256(), nullptr);
    return out;
}

bool constant_time_equal(std::span<const uint8_t> a, std::span<const uint8_t> b) {
    return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

Status random_bytes(std::span<uint8_t> out) {
    if (out.empty()) return ok_status();
    if (RAND_bytes(out.data(), int(out.size())) != 1)
        return internal_error("the system's random source (OpenSSL RAND_bytes) failed");
    return ok_status();
}

Result<std::vector<uint8_t>> from_hex(std::string_view hex, size_t expected_len,
                                      std::string_view what) {
    if (hex.size() != expected_len * 2)
        return invalid_argument(fmt::format("{} must be {} hex digits, got {} characters", what,
                                            expected_len * 2, hex.size()));
    auto nibble = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        return -1;
    };
    std::vector<uint8_t> out(expected_len);
    for (size_t i = 0; i < expected_len; ++i) {
        int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) return invalid_argument(fmt::format("{} is not hex", what));
        out[i] = uint8_t(hi << 4 | lo);
    }
    return out;
}

Result<Secret> load_secret_file(const std::string& path) {
    FileFd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (f.fd < 0)
        return errno_status(fmt::format("secret file {}: cannot open it", path))
            .with_context("pass a readable one with --secret-file");
    struct stat st {};
    if (::fstat(f.fd, &st) != 0) return errno_status(fmt::format("secret file {}: stat", path));
    if (!S_ISREG(st.st_mode))
        return invalid_argument(fmt::format("secret file {} is not a regular file", path));
    if (st.st_mode & 077)
        return permission_denied(
            fmt::format("secret file {} may be read by group or others (mode "
                        "{:03o}): run chmod 600 {}",
                        path, st.st_mode & 0777, path));
    if (st.st_size == 0)
        return invalid_argument(
            fmt::format("secret file {} is empty: delete it to have one generated, "
                        "or fill it with at least "
                        "{} random bytes",
                        path, Secret::kMinBytes));
    if (size_t(st.st_size) < Secret::kMinBytes || size_t(st.st_size) > Secret::kMaxBytes)
        return invalid_argument(
            fmt::format("secret file {} holds {} bytes; a secret needs {} to {} "
                        "(e.g. head -c 32 "
                        "/dev/urandom)",
                        path, st.st_size, Secret::kMinBytes, Secret::kMaxBytes));
    std::vector<uint8_t> buf(size_t(st.st_size));
    size_t got = 0;
    while (got < buf.size()) {
        ssize_t r = ::read(f.fd, buf.data() + got, buf.size() - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return errno_status(fmt::format("secret file {}: read", path));
        got += size_t(r);
    }
    auto s = Secret::from_bytes(buf);
    OPENSSL_cleanse(buf.data(), buf.size());
    if (!s.ok()) return s.status().with_context(fmt::format("secret file {}", path));
    return s;
}

Result<Secret> load_or_create_secret_file(const std::string& path) {
    if (path.empty()) return invalid_argument("no secret file named");
    if (::access(path.c_str(), F_OK) == 0 || errno != ENOENT) return load_secret_file(path);
    FERRY_RETURN_IF_ERROR(make_parent_dirs(path));
    std::array<uint8_t, Secret::kGeneratedBytes> key{};
    uint64_t tag = 0;
    FERRY_RETURN_IF_ERROR(random_bytes(key));
    FERRY_RETURN_IF_ERROR(random_bytes({reinterpret_cast<uint8_t*>(&tag), sizeof tag}));
    std::string tmp = fmt::format("{}.tmp-{}-{:016x}", path, ::getpid(), tag);
    {
        FileFd f(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
        if (f.fd < 0)
            return errno_status(fmt::format("secret file {}: cannot create {}", path, tmp));
        size_t put = 0;
        while (put < key.size()) {
            ssize_t w = ::write(f.fd, key.data() + put, key.size() - put);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) {
                Status s = errno_status(fmt::format("secret file {}: write", path));
                ::unlink(tmp.c_str());
                return s;
            }
            put += size_t(w);
        }
        OPENSSL_cleanse(key.data(), key.size());
        // Complete on disk before it gets its name: a reader never sees a partial
        // secret.
        if (::fsync(f.fd) != 0) {
            Status s = errno_status(fmt::format("secret file {}: fsync", path));
            ::unlink(tmp.c_str());
            return s;
        }
    }
    // link(2) fails with EEXIST instead of replacing, unlike rename(2): the first
    // one wins.
    int rc = ::link(tmp.c_str(), path.c_str());
    int link_errno = errno;
    ::unlink(tmp.c_str());
    if (rc != 0 && link_errno != EEXIST) {
        errno = link_errno;
        return errno_status(fmt::format("secret file {}: cannot create it", path));
    }
    return load_secret_file(path);
}

}  // namespace ferry
