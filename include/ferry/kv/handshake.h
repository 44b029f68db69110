// Side channel for KV transfers: a small TCP service per engine rank that tells a peer how to
// reach it (engine address, pool descriptor, layout, TP position) before any transfer. The
// caller checks the compatibility hash before use; results are cached per endpoint; the
// epoch (random per server start) tells a restarted peer apart from the one cached.
//
// Both sides prove they hold the deployment secret (challenge-response with a nonce from each,
// HMAC-SHA256) before anything about the rank leaves; a peer that does not prove it gets one
// "authentication failed" frame and a close. The answer is MACed too, so a caller knows it came
// from a holder of the secret. Frames: docs/PROTOCOL.md.
//
// The server serves its connections concurrently from one poll loop, each within a deadline
// (a shorter one until the client proved the secret), and closes connections beyond a cap (in
// all, and per client address) at once, so idle or slow clients cannot hold it up.
//
// Handshakes run in the caller's thread, never on a connector thread, so a slow or dead peer
// only delays the request that needed it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ferry/common/auth.h"
#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/fabric/types.h"
#include "ferry/kv/layout.h"

namespace ferry::kv {

struct HandshakeInfo {
    // 2: mutual challenge-response under the deployment secret before the answer.
    // 3: the pool as one descriptor per region.
    static constexpr uint16_t kVersion = 3;

    uint64_t epoch = 0;  // changes whenever the serving process (re)starts its server
    EngineAddress address;
    std::vector<MemoryDescriptor> pool;  // one per region, in layout order (KvPoolRegions)
    KvLayout layout;
    uint32_t tp_rank = 0;
    uint32_t tp_size = 1;

    std::vector<uint8_t> serialize() const;
    static Result<HandshakeInfo> deserialize(std::span<const uint8_t> blob);
};

struct HandshakeServerOptions {
    Secret secret;  // the deployment's; required
    // A connection that has not finished its exchange by then is closed.
    Duration connection_deadline = std::chrono::seconds(1);
    // A connection whose client has not proven the secret (a valid AUTH) by then is closed,
    // if that comes before connection_deadline. A real client proves it one round trip after
    // its connect was accepted: whole handshakes took at most 5.1 ms beside 300 idle
    // connections on the 2-core dev VM; 500 ms leaves room for one lost segment (Linux's least
    // retransmission timeout is 200 ms) and keeps what an idle connection holds short.
    Duration proof_deadline = std::chrono::milliseconds(500);
    // Open connections beyond this are closed as soon as they are accepted.
    size_t max_connections = 256;
    // Open connections from one source address beyond this are closed as soon as they are
    // accepted, so that one client cannot hold all max_connections: 300 idle connections from
    // one address, reopened as they closed, made 132 of 133 real handshakes fail. A serving
    // engine handshakes from its one KV link thread, one peer at a time, so an address opens
    // about as many at once as its host runs engines: 32 is four times the 8 of an 8-GPU host.
    size_t max_connections_per_client = 32;
};

class HandshakeServer {
  public:
    // Listens on host:port (port 0 picks a free one; see port()). info.epoch is replaced by
    // a fresh random value.
    static Result<std::unique_ptr<HandshakeServer>> start(const std::string& host, uint16_t port,
                                                          HandshakeInfo info,
                                                          HandshakeServerOptions options);
    ~HandshakeServer();  // stops accepting and joins the thread
    HandshakeServer(const HandshakeServer&) = delete;
    HandshakeServer& operator=(const HandshakeServer&) = delete;

    uint16_t port() const;
    uint64_t epoch() const;
    uint64_t requests_served() const;  // answers given to authenticated peers
    uint64_t auth_failures() const;    // peers that did not prove the secret
    // Connections closed at once: max_connections open, or max_connections_per_client open
    // from the same address.
    uint64_t refused_over_cap() const;

    class Impl;

  private:
    explicit HandshakeServer(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

// One handshake: connect, prove the secret and check the server's proof, send the
// compatibility hash the caller expects, read the answer. A peer whose layout hash differs
// answers with an error naming its layout; with `mine` (this side's layout, optional) the
// error also names this side's and the fields that differ. A peer without the secret is a
// kPermissionDenied. `refused` (optional) is set when the endpoint refused the connection
// (nothing listens).
Result<HandshakeInfo> fetch_handshake(const std::string& host, uint16_t port,
                                      uint64_t expected_compat_hash, const Secret& secret,
                                      Duration timeout, bool* refused = nullptr,
                                      const KvLayout* mine = nullptr);

// Handshake results by endpoint. Lookups of different endpoints never wait for each other.
class HandshakeCache {
  public:
    HandshakeCache(uint64_t expected_compat_hash, Secret secret)
        : hash_(expected_compat_hash), secret_(std::move(secret)) {}
    // With this side's layout: a peer's incompatible layout is named field by field.
    HandshakeCache(const KvLayout& mine, Secret secret)
        : hash_(mine.compatibility_hash()), mine_(mine), secret_(std::move(secret)) {}

    // The cached answer, or a fresh handshake on a miss.
    Result<HandshakeInfo> get(const std::string& host, uint16_t port, Duration timeout);

    struct Refreshed {
        HandshakeInfo info;
        bool restarted = false;  // the epoch changed: connections and descriptors are stale
    };
    // Handshakes again (after a transfer to this peer failed) and replaces the cached entry.
    Result<Refreshed> refresh(const std::string& host, uint16_t port, Duration timeout);

    // What the process at an endpoint cached before is now, for a watch that ends the
    // transfers of a peer that is gone. kGone only when the endpoint refuses connections
    // (nothing listens: the process exited, or closed its side channel, which it does only
    // after its connector stopped), never on a timeout: a slow or frozen peer is the lease's.
    struct Probe {
        enum class State { kSame, kRestarted, kGone, kUnknown };
        State state = State::kUnknown;
        std::optional<HandshakeInfo> previous;  // the answer cached before the probe
        Status why;                             // kGone and kUnknown: what failed
    };
    // Handshakes again. kRestarted: the cache holds the new process's answer; kGone: the
    // entry is dropped; otherwise the cache is as it was (kSame: refreshed).
    Probe probe(const std::string& host, uint16_t port, Duration timeout);

    void forget(const std::string& host, uint16_t port);
    size_t size() const;

  private:
    uint64_t hash_;
    std::optional<KvLayout> mine_;
    Secret secret_;
    mutable std::mutex mu_;
    std::map<std::string, HandshakeInfo> entries_;
};

}  // namespace ferry::kv
