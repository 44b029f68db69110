// The transfer ids live on one connector, checked in the caller's thread (private to src/kv).
//
// Transfer ids are 64 bits, and an engine may derive them from longer request ids (serve hashes
// its string ids): two requests can meet on one id. Without a check the second registration
// would supersede or cancel the first request's transfer, and the callbacks, keyed by id,
// would report one request's result for the other. So a registration, announcement, pull or
// offer whose id another live transfer holds is refused at once with kAlreadyExists, before
// anything is queued, and no callback ever fires for it.
//
// What counts as the same transfer: decode's announce and then register_push of one
// (id, attempt), and a newer attempt of a registered id (a retry supersedes the older one).
#pragma once

#include <cstdint>
#include <mutex>
#include <set>
#include <tuple>

#include "ferry/common/status.h"

namespace ferry::kv::detail {

class TransferIds {
  public:
    enum class Kind : uint8_t { kAnnounced, kRegistered, kPulling, kOffered };

    // Claims (id, attempt) for `kind`, or says which live transfer holds the id.
    Status claim(uint64_t id, uint32_t attempt, Kind kind);
    // The claim ends (the transfer was reported); unknown claims are ignored.
    void release(uint64_t id, uint32_t attempt, Kind kind);
    size_t live() const;

  private:
    mutable std::mutex mu_;
    std::set<std::tuple<uint64_t, uint32_t, Kind>> claims_;
};

}  // namespace ferry::kv::detail
