#include "transfer_ids.h"

#include <fmt/format.h>

namespace ferry::kv::detail {
namespace {

const char* kind_name(TransferIds::Kind k) {
    switch (k) {
        case TransferIds::Kind::kAnnounced:
            return "announced";
        case TransferIds::Kind::kRegistered:
            return "registered for a push";
        case TransferIds::Kind::kPulling:
            return "being pulled";
        case TransferIds::Kind::kOffered:
            return "offered for pull";
    }
    return "live";
}

bool decode_side(TransferIds::Kind k) { return k != TransferIds::Kind::kOffered; }

// Whether a live claim `held` lets a new claim of (attempt, kind) of the same id through.
bool compatible(uint32_t held_attempt, TransferIds::Kind held, uint32_t attempt,
                TransferIds::Kind kind) {
    using K = TransferIds::Kind;
    if (decode_side(held) != decode_side(kind)) return true;  // two sides of one rank
    if (kind == K::kOffered || kind == K::kPulling || held == K::kPulling) return false;
    // Push on decode: a newer attempt supersedes every older one; one attempt is announced
    // once and then registered once.
    if (attempt > held_attempt) return true;
    return attempt == held_attempt && held == K::kAnnounced && kind == K::kRegistered;
}

}  // namespace

Status TransferIds::claim(uint64_t id, uint32_t attempt, Kind kind) {
    std::lock_guard lk(mu_);
    for (auto it = claims_.lower_bound({id, 0, Kind::kAnnounced});
         it != claims_.end() && std::get<0>(*it) == id; ++it) {
        auto [_, held_attempt, held] = *it;
        if (compatible(held_attempt, held, attempt, kind)) continue;
        return already_exists(fmt::format(
            "transfer id {:#x} already exists on this rank: attempt {} of it is {}; a transfer "
            "id must be unique among live transfers (another request with the same id, or a "
            "repeated call for this one?)",
            id, held_attempt, kind_name(held)));
    }
    claims_.insert({id, attempt, kind});
    return ok_status();
}

void TransferIds::release(uint64_t id, uint32_t attempt, Kind kind) {
    std::lock_guard lk(mu_);
    claims_.erase({id, attempt, kind});
}

size_t TransferIds::live() const {
    std::lock_guard lk(mu_);
    return claims_.size();
}

}  // namespace ferry::kv::detail
