// The connector keys a transfer by 64 bits; deployments name transfers by strings (the
// router's "<nonce>-<counter>"). transfer_key() gives both sides of a transfer the same 64 bits
// without another message; TransferKeys is the live map of one connector's user that makes
// sure two different strings never share a key silently: the second one is refused while the
// first is in use.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

#include "ferry/common/status.h"

namespace ferry::kv {

// FNV-1a over the bytes of `id`: stable across builds and platforms (std::hash is neither).
uint64_t transfer_key(std::string_view id);

// Thread-safe.
class TransferKeys {
  public:
    using Hash = std::function<uint64_t(std::string_view)>;
    // `hash` is transfer_key unless a test forces collisions.
    explicit TransferKeys(Hash hash = transfer_key);

    // The key of `id`, now held once more (every acquire is matched by one release). When
    // another id in use has the same key: kInvalidArgument naming both, and nothing is held.
    Result<uint64_t> acquire(const std::string& id);
    // The key `id` has or would get, without holding it; the same error as acquire when another
    // id in use holds that key.
    Result<uint64_t> key_of(const std::string& id) const;
    // Drops one hold of `id`; an id not held: nothing.
    void release(const std::string& id);
    // Ids held now.
    size_t size() const;

  private:
    Result<uint64_t> check_locked(const std::string& id) const;

    const Hash hash_;
    mutable std::mutex mu_;
    struct Held {
        std::string id;
        uint32_t holds = 0;
    };
    std::map<uint64_t, Held> held_;  // by key
};

}  // namespace ferry::kv
