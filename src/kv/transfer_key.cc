#include "ferry/kv/transfer_key.h"

#include <fmt/format.h>

namespace ferry::kv {

uint64_t transfer_key(std::string_view id) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char c : id) {
        h ^= c;
        h *= 0x100000001b3ull;
    }
    return h;
}

TransferKeys::TransferKeys(Hash hash) : hash_(std::move(hash)) {}

Result<uint64_t> TransferKeys::check_locked(const std::string& id) const {
    uint64_t key = hash_(id);
    auto it = held_.find(key);
    if (it != held_.end() && it->second.id != id) {
        return invalid_argument(fmt::format(
            "transfer id '{}' has the same 64-bit key {:#x} as transfer '{}' in progress; "
            "refused so that the two cannot mix: retry with another transfer id",
            id, key, it->second.id));
    }
    return key;
}

Result<uint64_t> TransferKeys::acquire(const std::string& id) {
    std::lock_guard lk(mu_);
    FERRY_ASSIGN_OR_RETURN(uint64_t key, check_locked(id));
    Held& h = held_[key];
    h.id = id;
    h.holds++;
    return key;
}

Result<uint64_t> TransferKeys::key_of(const std::string& id) const {
    std::lock_guard lk(mu_);
    return check_locked(id);
}

void TransferKeys::release(const std::string& id) {
    std::lock_guard lk(mu_);
    auto it = held_.find(hash_(id));
    if (it == held_.end() || it->second.id != id) return;
    if (--it->second.holds == 0) held_.erase(it);
}

size_t TransferKeys::size() const {
    std::lock_guard lk(mu_);
    return held_.size();
}

}  // namespace ferry::kv
