// The serve seam (KvProducer / KvConsumer) on the real KV layer: a TransferEngine with the
// engine's pool registered, a kv::KvConnector, and a HandshakeServer on a side-channel port.
// One FabricKvLink per engine process; prefill uses it as producer, decode as consumer.
//
// The link keeps only what maps the engine's view onto the connector's: which callback belongs
// to which transfer key (the 64-bit id the kv layer's messages carry, from the leg's string
// transfer id through kv::TransferKeys, so that two transfer ids never share a key silently),
// and which peer a decode leg came from. The per-transfer state itself
// (attempts, segments, writes, leases) is the connector's; what a request waits for is the
// engine's.
//
// Peers are named the way the router names them: kv_transfer_params carry the peer's HTTP
// host:port. The link asks that engine's GET /health for its side-channel port once, then
// handshakes (address, pool descriptor, layout, compatibility hash; both sides prove the
// deployment secret first) and caches the answer; a
// transfer to a peer that failed is re-handshaken, so a restarted peer is picked up. A watch
// thread handshakes again with every cached peer each peer_check_interval: a peer whose side
// channel refuses connections (its process is gone) or answers with another epoch (a new
// process) is dropped from the cache and its transfers here fail at once, instead of at the
// lease.
// Handshakes run on the link's own thread (or, for the pull-inline baseline, in the engine
// loop, as that baseline does everything there), never on the connector's thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "ferry/common/auth.h"
#include "ferry/common/clock.h"
#include "ferry/kv/connector.h"
#include "ferry/kv/handshake.h"
#include "ferry/kv/transfer_mode.h"
#include "serve/kv_connector.h"
#include "serve/kv_pool.h"
#include "serve/setting_names.h"

namespace ferry::serve {

struct FabricKvLinkConfig {
    std::string engine_id;
    kv::TransferMode mode = kv::TransferMode::kPush;
    // libfabric provider: shm between processes of one host, tcp across hosts.
    std::string provider = "shm";
    // Address the side channel listens on and the tcp provider binds to.
    std::string host = "127.0.0.1";
    int side_port = 0;  // 0 picks a free one (see side_port())
    // How long one side holds blocks for a transfer that does not progress: the engines' KV
    // wait, serve::kv_lease(EngineConfig), as the ferry command sets it.
    Duration lease = seconds(30);
    // Pull offers: registered on their own and closed when they end (a late read fails), or
    // read under the pool's keys (kPool: no registration per offer). docs/PROTOCOL.md.
    kv::PullKeys pull_keys = kv::PullKeys::kPerOffer;
    Duration handshake_timeout = seconds(5);
    // A write or read not completed by then fails: how a dead peer becomes an error.
    Duration op_timeout = seconds(10);
    // The fabric engine's rails (ferry::EngineConfig::num_rails and ::rails): how many NICs
    // (domains) it opens, and which carry each region ("nearest", "all" or NIC names).
    int num_rails = 1;
    std::string rails = "nearest";
    // How often the peers this link talks to are checked for having gone or restarted (a
    // handshake each); zero: never. 500 ms is the router's own health-check period, so a
    // restarted prefill is noticed here about when the router sends it traffic again.
    Duration peer_check_interval = milliseconds(500);
    // The deployment's (required): the side channel answers only peers that prove it, and
    // legs' kv_transfer_params are acted on only when signed under it (kv_params_auth.h).
    Secret secret{};
    // The side channel's limits (kv::HandshakeServerOptions says why these defaults): open
    // connections in all, open connections from one address, and how long a connection may
    // stay open before its client proved the secret.
    size_t side_max_connections = kv::HandshakeServerOptions{}.max_connections;
    size_t side_max_connections_per_client =
        kv::HandshakeServerOptions{}.max_connections_per_client;
    Duration side_proof_deadline = kv::HandshakeServerOptions{}.proof_deadline;
    // The connector's 64-bit key of a string transfer id; empty: kv::transfer_key. Tests set
    // it to force collisions (kv::TransferKeys refuses the second id on a key in use).
    std::function<uint64_t(std::string_view)> transfer_hash;
    // What errors call these settings (setting_names.h); empty: their field names.
    SettingNames setting_names{};
};

struct FabricKvLinkStats {
    uint64_t transfers_ok = 0;
    uint64_t transfers_failed = 0;
    uint64_t bytes = 0;
    uint64_t handshakes = 0;
    uint64_t active = 0;  // transfers holding blocks now
};

class FabricKvLink : public KvProducer, public KvConsumer {
  public:
    // `pool` must outlive the link.
    static Result<std::unique_ptr<FabricKvLink>> create(const FabricKvLinkConfig& config,
                                                        KvPool* pool);
    // stop(), then releases the engine.
    ~FabricKvLink() override;
    FabricKvLink(const FabricKvLink&) = delete;
    FabricKvLink& operator=(const FabricKvLink&) = delete;

    // The HTTP address this engine serves on: pull-mode prefill responses name it so that the
    // decode engine finds this one the same way it finds a push-mode peer.
    void set_http_address(const std::string& host, int port);
    int side_port() const;
    // Ok once peers can reach this link: its side channel listens and it knows the HTTP
    // address it names in pull offers (set_http_address); the reason otherwise, kUnavailable
    // while it starts, kProvider for good once its transfer engine lost a rail
    // (TransferEngine::health: a worker spinning inside libfabric; only a restart helps).
    Status ready() const;
    // The link's transfer engine (its counters, its health).
    TransferEngine& transfer_engine() const;
    const std::string& provider() const;
    FabricKvLinkStats stats() const;
    // Prometheus lines for the engine's /metrics.
    std::string prometheus_text() const;

    // Fails what is pending with kCancelled (every callback runs once), joins the threads.
    void stop();

    void on_prefill_scheduled(const std::string& transfer, const KvTransferParams& params) override;
    void on_prefill_progress(const std::string& transfer, const KvTransferParams& params,
                             const std::vector<BlockId>& blocks,
                             const kv::KvFrontier& ready) override;
    size_t max_progress_handovers() const override;
    Result<KvTransferParams> on_prefill_done(const std::string& transfer,
                                             const KvTransferParams& params,
                                             std::vector<BlockId> blocks, size_t num_tokens,
                                             KvDoneCallback release) override;
    void on_prefill_aborted(const std::string& transfer, const KvTransferParams& params,
                            const Status& why, KvDoneCallback release) override;
    void on_transfer_aborted(const std::string& transfer, const KvTransferParams& params,
                             const Status& why) override;
    void on_consumer_gave_up(GaveUpHandler stop) override;
    Status await_prefill_scheduled(const std::string& transfer, const KvTransferParams& params,
                                   KvDoneCallback scheduled) override;
    Status on_blocks_allocated(const std::string& transfer, const KvTransferParams& params,
                               std::vector<BlockId> blocks, size_t num_tokens,
                               KvDoneCallback arrived, KvProgressCallback progress) override;
    void cancel(const std::string& transfer) override;
    // Both roles: kv_transfer_params must carry the router's tag for this request and engine,
    // signed for this link's incarnation, unexpired and not used before (kv_params_auth.h,
    // LegTagLedger).
    Status authorize(const KvTransferParams& params) const override;
    // Drawn at random when the link is made: the engine states it in /health and the router
    // signs it into each leg for this engine, so a process restarted on the same ports takes
    // none of the legs signed for this one.
    const std::string& incarnation() const;

    class Impl;

  private:
    explicit FabricKvLink(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::serve
