// An inference engine step loop in the manner of vLLM: continuous batching under
// max_num_seqs / max_model_len, a FIFO scheduler that admits a waiting request once its KV
// blocks are free, prefill steps ahead of decode steps (optionally chunked: a step computes at
// most prefill_chunk_tokens prompt tokens), tokens streamed to each request as its step ends.
//
// Compute is modelled: a step lasts the time the cost model gives for its batch (times
// time_scale), spent sleeping. KV is real: prefill writes the synthetic model's KV bytes into
// the pool, a KV connector moves them between engines, and decode derives every token from the
// bytes it holds (see synthetic_model.h).
//
// One engine serves all three kinds of request:
//  - colocated (no kv_transfer_params): prefill and decode here;
//  - prefill leg (do_remote_decode): prefill here, one token back, KV handed to the KvProducer
//    (chunk by chunk with chunked prefill, so a push connector writes while later chunks
//    compute);
//  - decode leg (do_remote_prefill): push legs first wait until the prefill engine scheduled
//    the transfer, then blocks are allocated, the KvConsumer fills them (the engine digests
//    the KV as it lands), decode here.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/kv/block_pool.h"
#include "serve/cost_model.h"
#include "serve/kv_connector.h"
#include "serve/kv_pool.h"
#include "serve/metrics.h"
#include "serve/synthetic_model.h"

namespace ferry::serve {

// Most sequences an engine batches (EngineConfig::max_num_seqs): vLLM's defaults are 256 to
// 1024; 10^9 was taken as no bound at all.
inline constexpr size_t kMaxNumSeqs = 65536;

struct EngineConfig {
    std::string engine_id = "engine-0";
    size_t max_num_seqs = 256;
    size_t max_model_len = 32768;
    // Prompt tokens per prefill step; a longer prompt runs alone (no chunked prefill).
    size_t max_num_batched_tokens = 16384;
    // Chunked prefill when > 0: a prefill step computes at most this many prompt tokens (the
    // oldest prompts first), ending a chunk that does not finish its prompt on a block
    // boundary; new prompts are admitted only while a step's budget is not yet spoken for.
    size_t prefill_chunk_tokens = 0;
    // Push: a step with a push leg is computed in this many groups of layers (at most the
    // model's layers), and each chunk's KV is handed to the connector group by group (the
    // last chunk at every group; earlier ones as often as the connector's piece limit per
    // prompt allows), so copies run alongside compute and only the last group's copy and
    // digest follow the step. 1: each chunk goes out whole after its step.
    int push_layer_groups = 1;
    // Decode legs: where the first token comes from. kPrefill: the token prefill sampled at
    // the end of its step travels with the KV, so decode streams it as soon as the KV is in
    // and digested (SGLang's and TensorRT-LLM's disaggregation do this); decode's first step
    // then computes the second token. The synthetic model derives that token from the KV
    // decode received, so a wrong KV still shows in it. kDecode: decode computes the first
    // token in its first step over the received KV (vLLM's disaggregation: the last prompt
    // token is recomputed there), one decode step later.
    enum class FirstToken { kPrefill, kDecode };
    FirstToken first_token = FirstToken::kPrefill;
    size_t num_blocks = 4096;
    int block_size = 16;
    int head_offset = 0;      // global index of this rank's first KV head
    double time_scale = 1.0;  // multiplies modelled step times; tests run faster than real
    // The KV wait, one setting for the deployment: how long a decode leg waits for the prefill
    // engine to schedule its transfer (push), then, once its blocks are allocated, for its KV.
    // A leg that waited this long is cancelled and fails. A KV connector's lease (how long a
    // side holds blocks for a transfer that does not progress) derives from it: kv_lease().
    Duration kv_wait_timeout = seconds(30);
};

// The lease to give a KV connector (FabricKvLinkConfig::lease, InProcessKvLinkConfig::lease)
// of engines whose decode legs wait `config.kv_wait_timeout` for their KV: no decode leg
// waits longer for the blocks a prefill holds for it, and a decode leg's own wait ends at
// the engine's deadline (its message names kv_wait_timeout) before the lease runs out, as
// the lease starts no later and is renewed while prefill computes. The two used to be set
// apart, both 30 s, so which one ended a wait depended on which flag was lower.
inline Duration kv_lease(const EngineConfig& config) { return config.kv_wait_timeout; }

// First layer of layer group g (0-based) of a push step, `groups` over `layers`; g = groups
// gives `layers`, so group g is [layer_group_end(g), layer_group_end(g + 1)). Groups shrink
// towards the end: copies run behind compute and only the last group's copy and digest are
// left after the step, so it should be small, while earlier ones have the compute of the
// groups after them to hide theirs. Group g-1 ends at layers - layers * ((groups - g) /
// groups)^2, rounded, with at least one layer per group (64 layers in 8 groups: 15, 13, 11,
// 9, 7, 5, 3, 1). Even groups of 8 left a 2 MiB copy after a 1k-token step (2026-12-01).
// Requires 1 <= groups <= layers.
int layer_group_end(int g, int groups, int layers);

struct GenerateRequest {
    std::vector<int32_t> prompt{};
    size_t max_tokens = 16;
    KvTransferParams kv{};
};

// When a request passed each stage: explains its TTFT. remote_scheduled: a push decode leg
// heard that the prefill engine scheduled its transfer.
struct RequestTiming {
    TimePoint arrived{}, remote_scheduled{}, scheduled{}, prefill_start{}, prefill_end{},
        kv_ready{}, first_token{}, finished{};
};

// The client's view of one request: tokens as they are produced, then the end.
class RequestHandle {
  public:
    struct Event {
        bool finished = false;  // no more tokens; status() says how it ended
        int32_t token = -1;
    };
    // Waits for the next token or the end until `deadline` (then a timeout error).
    Result<Event> next(TimePoint deadline);
    // Asks the engine to stop the request and free its blocks; safe from any thread.
    void cancel();

    const RequestId& id() const { return id_; }
    // Valid once next() returned finished.
    Status status() const;
    KvTransferParams kv_out() const;
    RequestTiming timing() const;
    size_t prompt_tokens() const { return prompt_tokens_; }

  private:
    friend class Engine;
    RequestHandle(RequestId id, size_t prompt_tokens, std::function<void()> on_cancel)
        : id_(std::move(id)), prompt_tokens_(prompt_tokens), on_cancel_(std::move(on_cancel)) {}
    void push(int32_t token, TimePoint at);
    void finish(Status status, KvTransferParams kv_out, TimePoint at);
    bool finished() const {
        std::lock_guard lock(mu_);
        return finished_;
    }

    const RequestId id_;
    const size_t prompt_tokens_;
    std::function<void()> on_cancel_;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::deque<int32_t> tokens_;
    bool finished_ = false;
    Status status_;
    KvTransferParams kv_out_;
    RequestTiming timing_;
    std::atomic<bool> cancelled_{false};
};

struct EngineStats {
    size_t waiting = 0, running = 0, waiting_for_kv = 0, held_for_transfer = 0;
    size_t waiting_for_prefill = 0;
    size_t blocks_total = 0, blocks_used = 0, blocks_free = 0;
    uint64_t requests_total = 0, requests_failed = 0, prompt_tokens = 0, generated_tokens = 0;
    uint64_t prefill_steps = 0, decode_steps = 0;
    uint64_t kv_transfers = 0, kv_transfer_failures = 0, kv_transfer_bytes = 0;
};

class Engine {
  public:
    static Result<std::unique_ptr<Engine>> create(EngineConfig config, CostModel cost);
    ~Engine();
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    // The connector must outlive the engine's loop (stop() first). Call before start().
    void attach_connector(KvProducer* producer, KvConsumer* consumer);
    Status start();
    // Fails every request still in flight with kCancelled and joins the loop.
    void stop();

    // Checks the request against the engine's limits and queues it.
    Result<std::shared_ptr<RequestHandle>> submit(GenerateRequest request);
    // Ends every request of this transfer id here (the router's answer to a failed other leg:
    // a decode leg whose prefill leg was refused would otherwise hold blocks until its
    // kv_wait_timeout).
    Status abort_transfer(const std::string& transfer_id, const std::string& reason);

    const EngineConfig& config() const { return config_; }
    const CostModel& cost_model() const { return cost_; }
    const KvSlice& kv_slice() const { return slice_; }
    KvPool& pool() { return *pool_; }
    EngineStats stats() const;
    std::string prometheus_text() const;

  private:
    struct Seq;
    enum class Stage;
    struct Inbox;
    enum class InboxKind;
    struct InboxEvent;
    Engine(EngineConfig config, CostModel cost, std::unique_ptr<KvPool> pool);

    static std::string_view stage_name(Stage stage);
    void loop();
    void drain_inbox();
    void handle(InboxEvent& e);
    // A submitted request enters its first stage.
    void accept(std::unique_ptr<Seq> seq);
    Seq* find(const RequestId& id);
    void enter(Seq& seq, Stage stage);
    // The requests in `stage`, oldest in it first.
    std::vector<Seq*> in_stage(Stage stage) const;
    // Gives the request's blocks back and forgets it; `seq` and its id are gone after.
    void retire(RequestId id);
    // A decode leg answered while the connector or a digest job may still use its blocks.
    void drain(Seq& seq, const Status& why);
    // A prefill leg whose blocks the connector reads until it releases them.
    void hold(Seq& seq);
    void cancel_transfer(const std::string& transfer_id, const Status& reason);
    struct StepChunk {
        Seq* seq;
        size_t tokens;
    };
    void admit(std::vector<Seq*>& prefill_batch);
    std::vector<StepChunk> plan_prefill_step() const;
    // Progress hand-overs a push leg's chunk ending at chunk_end gets in a step of `groups`
    // layer groups, within the connector's limit per prompt.
    int progress_handovers(const Seq& s, size_t chunk_end, int groups) const;
    void run_prefill(const std::vector<StepChunk>& step);
    void run_decode();
    void expire_kv_waits();
    void on_kv_arrived(const RequestId& id, const Status& status);
    void advance_kv(const RequestId& id);
    void abort_prefill(Seq& seq, const Status& why);
    void cancel_seq(const RequestId& id, const Status& why);
    bool sleep_until(TimePoint t);  // false when stopping
    void finish(Seq& seq, Status status, KvTransferParams kv_out = {});
    void fail_all(const Status& status);
    void publish_gauges();
    size_t blocks_needed(const GenerateRequest& r) const;
    void digest_worker();

    const EngineConfig config_;
    const CostModel cost_;
    KvSlice slice_;
    std::unique_ptr<KvPool> pool_;
    kv::BlockPool blocks_;  // which request holds which block of pool_
    KvProducer* producer_ = nullptr;
    KvConsumer* consumer_ = nullptr;

    std::shared_ptr<Inbox> inbox_;  // shared with callbacks that may outlive the engine
    std::thread loop_thread_;
    std::thread digest_thread_;
    std::atomic<bool> running_{false};
    std::atomic<uint64_t> next_id_{1};

    // Owned by the loop thread: every request of this engine, each in its stage (engine.cc).
    std::map<RequestId, std::unique_ptr<Seq>> requests_;
    uint64_t next_order_ = 0;                   // Seq::order of the next stage entry
    std::map<std::string, TimePoint> aborted_;  // transfer ids aborted recently, until when

    // Read by stats() from any thread.
    mutable std::mutex stats_mu_;
    EngineStats counters_;
    Histogram transfer_latency_{latency_buckets_seconds()};
};

}  // namespace ferry::serve
