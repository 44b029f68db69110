// The OpenAI-style completions API of an engine: request parsing with messages a client can act
// on, response and server-sent-event bodies, and kv_transfer_params in vLLM's field names.
// No HTTP here (see http.h), so all of it is testable without sockets.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/common/status.h"
#include "serve/engine.h"
#include "serve/json_splice.h"

namespace ferry::serve {

struct CompletionRequest {
    GenerateRequest gen{};
    bool stream = false;
    std::string model{};  // the client's, echoed in the answer; empty: the engine's name
};

// The longest `model` a request may name (it is echoed in every event of a stream).
inline constexpr size_t kMaxModelNameBytes = 256;

// Text prompts are tokenized byte by byte (token id = byte value): the synthetic model needs
// ids, not language. Generated ids render as " tok<id>".
std::vector<int32_t> tokenize(std::string_view text);
std::string token_text(int32_t token);

// Parses a /v1/completions body. Errors are kInvalidArgument and name the offending field. A
// leading UTF-8 byte-order mark is skipped (scan_completion_request does the same). With
// max_prompt_tokens > 0 (an engine passes its max_model_len), a longer prompt is refused from its
// size, before any token vector (or, for a large body, any json) is built.
Result<CompletionRequest> parse_completion_request(std::string_view body,
                                                   size_t max_prompt_tokens = 0);
// The same for a body already parsed.
Result<CompletionRequest> parse_completion_json(const nlohmann::json& body,
                                                size_t max_prompt_tokens = 0);

// A /v1/completions body as the router relays it: checked as parse_completion_request checks it,
// with the same errors, but its members kept as text and a prompt of token ids only checked,
// never built into json (`ferry bench relay`, 16k ids: 2.6 ms to parse and dump both legs,
// 0.25 ms to scan and splice them).
struct CompletionRelayBody {
    JsonObjectText object{};  // views into the scanned body
    bool stream = false;
    size_t max_tokens = 0;  // as the engines read the body
    // The prompt's token ids, as the engines tokenize it: what the legs' tags bind
    // (kv_params_auth.h).
    std::vector<int32_t> prompt{};
};
Result<CompletionRelayBody> scan_completion_request(std::string_view body);

nlohmann::json kv_params_to_json(const KvTransferParams& kv);
Result<KvTransferParams> kv_params_from_json(const nlohmann::json& j);

// Per-request stage durations in ms, to explain a TTFT: queue (arrival to scheduled), prefill
// (compute), kv_wait (scheduled to KV arrived, decode legs), first_token, e2e.
nlohmann::json timing_to_json(const RequestTiming& t);

struct CompletionResult {
    std::string id{};
    std::string model{};
    std::vector<int32_t> tokens{};
    size_t prompt_tokens = 0;
    KvTransferParams kv_out{};
    RequestTiming timing{};
};
std::string completion_body(const CompletionResult& r);
// One streamed token, and the final chunk that carries finish_reason, usage and transfer
// parameters. Each returns a whole "data: ...\n\n" event.
std::string sse_token_event(const std::string& id, const std::string& model, int32_t token);
std::string sse_final_event(const CompletionResult& r);
std::string sse_error_event(const Status& status);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

// {"error": {"message": ..., "type": ..., "code": http}}, and the HTTP status for a Status.
std::string error_body(const Status& status);
// The message of an error body or event read back ({"error": {"message": ...}}), from a body of
// any shape: a message that is not a string is dumped, an "error" that is not an object is
// dumped, and anything else (not JSON, no "error") is `body` itself.
std::string error_message_of(std::string_view body);
int http_status_for(const Status& status);

// Splits a server-sent-event byte stream into the payloads of its "data:" lines.
class SseParser {
  public:
    // Appends bytes; returns the payloads completed by them.
    std::vector<std::string> feed(std::string_view bytes);

  private:
    std::string buffer_;
};

}  // namespace ferry::serve
