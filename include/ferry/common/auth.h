// Shared-secret authentication primitives: the secret of a deployment,
// HMAC-SHA256 under it, a constant-time comparison, random bytes, and the
// secret file the processes of a deployment share. All crypto is OpenSSL's
// libcrypto, nothing hand-written. Nothing here knows what is being
// authenticated; the layers above choose the messages and their domain labels.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/common/status.h"

namespace ferry {

using Digest = std::array<uint8_t, 32>;  // an HMAC-SHA256 tag

// Key bytes; wiped on destruction and never printed.
class Secret {
  public:
    static constexpr size_t kMinBytes = 16;        // 128 bits: below this a secret is refused
    static constexpr size_t kGeneratedBytes = 32;  // what generate() and new secret files hold
    static constexpr size_t kMaxBytes = 4096;

    Secret() = default;
    ~Secret();
    Secret(const Secret& o) = default;
    Secret& operator=(const Secret& o) = default;
    Secret(Secret&& o) noexcept = default;
    Secret& operator=(Secret&& o) noexcept = default;

    // Refuses fewer than kMinBytes or more than kMaxBytes.
    static Result<Secret> from_bytes(std::span<const uint8_t> bytes);
    static Result<Secret> generate();

    bool empty() const { return key_.empty(); }
    std::span<const uint8_t> bytes() const { return key_; }

  private:
    std::vector<uint8_t> key_;
};

// HMAC-SHA256 of `message` under `key` (an empty key is refused by the callers
// above).
Digest hmac_sha256(const Secret& key, std::span<const uint8_t> message);
// SHA-256 of `message` (no key): a digest that a tag then binds.
Digest sha256(std::span<const uint8_t> message);
// Equal length and bytes, in time that depends only on the length.
bool constant_time_equal(std::span<const uint8_t> a, std::span<const uint8_t> b);
// Cryptographically strong random bytes.
Status random_bytes(std::span<uint8_t> out);

// Lower- or upper-case hex (to_hex, the other way, is in ferry/fabric/types.h) of exactly
// `expected_len` bytes; `what` names the field in errors.
Result<std::vector<uint8_t>> from_hex(std::string_view hex, size_t expected_len,
                                      std::string_view what);

// The secret in `path`: a regular file of kMinBytes..kMaxBytes bytes, used as
// they are, that neither group nor others may read. Errors name the file and
// say what to do.
Result<Secret> load_secret_file(const std::string& path);
// load_secret_file, or, when `path` does not exist, a new file of
// kGeneratedBytes random bytes, mode 0600 (its folder is created 0700 if
// missing). Concurrent first calls agree: each writes a temporary file and
// link(2)s it to `path`; whoever loses the race reads the winner's.
Result<Secret> load_or_create_secret_file(const std::string& path);

}  // namespace ferry
