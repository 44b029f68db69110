#include "serve/openai_api.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <string>

namespace ferry::serve {
namespace {

using nlohmann::json;

std::string message_of(std::string_view body) {
    auto r = parse_completion_request(body);
    EXPECT_FALSE(r.ok()) << body;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    return r.status().message();
}

TEST(OpenAiApi, ParsesTextAndTokenPromptsStreamAndMaxTokens) {
    auto a = parse_completion_request(R"({"prompt": "hi", "max_tokens": 7, "stream": true})");
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    EXPECT_EQ(a->gen.prompt, (std::vector<int32_t>{'h', 'i'}));
    EXPECT_EQ(a->gen.max_tokens, 7u);
    EXPECT_TRUE(a->stream);
    auto b = parse_completion_request(R"({"model": "m", "prompt": [5, 6, 7]})");
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(b->gen.prompt, (std::vector<int32_t>{5, 6, 7}));
    EXPECT_EQ(b->gen.max_tokens, 16u);  // OpenAI's default
    EXPECT_FALSE(b->stream);
}

TEST(OpenAiApi, InvalidBodiesGetMessagesNamingTheField) {
    EXPECT_NE(message_of("{nope").find("not valid JSON"), std::string::npos);
    EXPECT_NE(message_of("[1]").find("JSON object"), std::string::npos);
    EXPECT_NE(message_of(R"({"max_tokens": 3})").find("'prompt' is required"), std::string::npos);
    EXPECT_NE(message_of(R"({"prompt": ""})").find("'prompt' is empty"), std::string::npos);
    EXPECT_NE(message_of(R"({"prompt": [1, "a"]})").find("'prompt'"), std::string::npos);
    EXPECT_NE(message_of(R"({"prompt": [[1], [2]]})").find("one prompt per request"),
              std::string::npos);
    EXPECT_NE(message_of(R"({"prompt": "x", "max_tokens": 0})").find("'max_tokens'"),
              std::string::npos);
    EXPECT_NE(message_of(R"({"prompt": "x", "stream": "yes"})").find("'stream'"),
              std::string::npos);
    EXPECT_NE(message_of(R"({"prompt": "x", "kv_transfer_params": {"remote_block_ids": [-1]}})")
                  .find("kv_transfer_params.remote_block_ids"),
              std::string::npos);
}

TEST(OpenAiApi, TokenIdsOutsideInt32AreOutOfRangeWithTheirValue) {
    for (const char* id : {"2147483648", "4294967296", "9223372036854775808",
                           "18446744073709551615", "-1", "-2147483649"}) {
        std::string msg = message_of(fmt::format(R"({{"prompt": [5, {}]}})", id));
        EXPECT_NE(msg.find(fmt::format("token id {} at index 1, out of range", id)),
                  std::string::npos)
            << msg;
        EXPECT_EQ(msg.find("negative token id"), std::string::npos) << msg;
    }
    auto top = parse_completion_request(R"({"prompt": [0, 2147483647]})");
    ASSERT_TRUE(top.ok()) << top.status().to_string();
    EXPECT_EQ(top->gen.prompt, (std::vector<int32_t>{0, INT32_MAX}));
}

// Engines (nlohmann) and the router's scanner agree on a body that starts with a UTF-8 byte-order
// mark: both accept it, and the router relays the object without the mark.
TEST(OpenAiApi, ByteOrderMarkIsAcceptedByTheEngineAndTheRouterPaths) {
    const std::string body = "\xEF\xBB\xBF{\"prompt\": [4, 5], \"stream\": true}";
    auto engine = parse_completion_request(body);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    EXPECT_EQ(engine->gen.prompt, (std::vector<int32_t>{4, 5}));
    auto relay = scan_completion_request(body);
    ASSERT_TRUE(relay.ok()) << relay.status().to_string();
    EXPECT_TRUE(relay->stream);
    std::string relayed = relay->object.with({{"max_tokens", 1}});
    EXPECT_EQ(relayed.find("\xEF"), std::string::npos) << relayed;
    auto again = parse_completion_request(relayed);
    ASSERT_TRUE(again.ok()) << relayed;
    EXPECT_EQ(again->gen.prompt, (std::vector<int32_t>{4, 5}));
    // A mark alone, or one in the middle, is still invalid on both paths.
    EXPECT_FALSE(parse_completion_request("\xEF\xBB\xBF").ok());
    EXPECT_FALSE(scan_completion_request("\xEF\xBB\xBF").ok());
    EXPECT_FALSE(scan_completion_request(" \xEF\xBB\xBF{\"prompt\": [1]}").ok());
}

TEST(OpenAiApi, PromptLongerThanTheLimitIsRefusedFromItsSize) {
    std::string ids = "[1";
    for (int i = 0; i < 1000; ++i) ids += ", 1";
    ids += "]";
    for (const std::string& prompt : {ids, "\"" + std::string(1001, 'x') + "\""}) {
        auto r = parse_completion_request(R"({"prompt": )" + prompt + "}", 1000);
        ASSERT_FALSE(r.ok());
        EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
        EXPECT_NE(r.status().message().find("has 1001 tokens, more than the engine's "
                                            "max_model_len 1000"),
                  std::string::npos)
            << r.status().message();
        // Without a limit, and with one it fits, the same prompt parses.
        EXPECT_TRUE(parse_completion_request(R"({"prompt": )" + prompt + "}").ok());
        EXPECT_TRUE(parse_completion_request(R"({"prompt": )" + prompt + "}", 1001).ok());
    }
    // A large body whose array is in limits but malformed still gets the parser's message.
    std::string bad = R"({"prompt": [1, 2,, 3], "pad": ")" + std::string(5000, 'p') + "\"}";
    EXPECT_NE(parse_completion_request(bad, 100).status().message().find("not valid JSON"),
              std::string::npos);
}

TEST(OpenAiApi, KvTransferParamsUseVllmFieldNamesBothWays) {
    auto r = parse_completion_request(R"({"prompt": [1], "kv_transfer_params": {
        "do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "p0",
        "remote_block_ids": [4, 9], "remote_host": "10.0.0.2", "remote_port": 5600,
        "tp_size": 2, "transfer_id": "abc"}})");
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    const KvTransferParams& kv = r->gen.kv;
    EXPECT_TRUE(kv.do_remote_prefill);
    EXPECT_EQ(kv.remote_engine_id, "p0");
    EXPECT_EQ(kv.remote_block_ids, (std::vector<BlockId>{4, 9}));
    EXPECT_EQ(kv.remote_port, 5600);
    EXPECT_EQ(kv.tp_size, 2);
    json back = kv_params_to_json(kv);
    auto again = kv_params_from_json(back);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->remote_block_ids, kv.remote_block_ids);
    EXPECT_EQ(again->transfer_id, "abc");
    EXPECT_EQ(back["remote_host"], "10.0.0.2");
}

TEST(OpenAiApi, SseParserReassemblesEventsSplitAcrossReads) {
    CompletionResult r{.id = "x", .model = "m", .tokens = {3, 4}, .prompt_tokens = 2};
    std::string stream = sse_token_event("x", "m", 3) + sse_token_event("x", "m", 4) +
                         sse_final_event(r) + std::string(kSseDone);
    SseParser p;
    std::vector<std::string> got;
    for (size_t i = 0; i < stream.size(); i += 7) {
        auto part = p.feed(std::string_view(stream).substr(i, 7));
        got.insert(got.end(), part.begin(), part.end());
    }
    ASSERT_EQ(got.size(), 4u);
    EXPECT_EQ(json::parse(got[0])["choices"][0]["token_ids"][0], 3);
    EXPECT_EQ(json::parse(got[2])["usage"]["completion_tokens"], 2);
    EXPECT_EQ(got[3], "[DONE]");
}

TEST(OpenAiApi, ErrorStatusesMapToHttpCodes) {
    EXPECT_EQ(http_status_for(invalid_argument("x")), 400);
    EXPECT_EQ(http_status_for(timeout_error("x")), 504);
    EXPECT_EQ(http_status_for(unavailable("x")), 503);
    json e = json::parse(error_body(invalid_argument("'prompt' is empty")));
    EXPECT_EQ(e["error"]["code"], 400);
    EXPECT_NE(e["error"]["message"].get<std::string>().find("'prompt' is empty"),
              std::string::npos);
}

// ---- the router's check of /v1/completions bodies ----------------------------------------------

// The relay check must accept exactly what the engines' full parse accepts, with its message.
void expect_same_verdict(const std::string& body) {
    auto full = parse_completion_request(body);
    auto relay = scan_completion_request(body);
    ASSERT_EQ(relay.ok(), full.ok()) << body << "\n full: " << full.status().to_string()
                                     << "\n relay: " << relay.status().to_string();
    if (full.ok()) {
        EXPECT_EQ(relay->stream, full->stream) << body;
        // What the router's tags bind is what the engine reads (kv_params_auth.h).
        EXPECT_EQ(relay->prompt, full->gen.prompt) << body;
        EXPECT_EQ(relay->max_tokens, full->gen.max_tokens) << body;
    } else {
        EXPECT_EQ(relay.status().code(), StatusCode::kInvalidArgument) << body;
        // The same message; the relay may add where it found the problem.
        EXPECT_TRUE(relay.status().message().starts_with(full.status().message()))
            << body << "\n full: " << full.status().message()
            << "\n relay: " << relay.status().message();
    }
}

TEST(CompletionRelay, TokenAndTextPromptsPassWithTheirStreamFlag) {
    auto a = scan_completion_request(R"({"prompt": [5, 0, 2147483647], "stream": true})");
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    EXPECT_TRUE(a->stream);
    EXPECT_EQ(a->object.find("prompt")->value, "[5, 0, 2147483647]");
    auto b = scan_completion_request(R"({"prompt": "hi \"there\"", "max_tokens": 3})");
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    EXPECT_FALSE(b->stream);
}

TEST(CompletionRelay, InvalidBodiesGetTheEnginesMessages) {
    const std::pair<std::string, std::string> cases[] = {
        {"not json", "not valid JSON"},
        {"[1, 2]", "JSON object"},
        {R"({"max_tokens": 3})", "'prompt' is required"},
        {R"({"prompt": 3})", "'prompt' must be a string or an array of token ids"},
        {R"({"prompt": []})", "'prompt' is empty"},
        {R"({"prompt": [1, -2]})", "'prompt' has token id -2 at index 1, out of range"},
        {R"({"prompt": [1, 2147483648]})",
         "'prompt' has token id 2147483648 at index 1, out of range"},
        {R"({"prompt": [1, 2.5]})",
         "'prompt' must be a string or an array of token ids; index 1 holds a number that is not "
         "an integer"},
        {R"({"prompt": [1, "a"]})",
         "'prompt' must be a string or an array of token ids; index 1 holds a string"},
        {R"({"prompt": [1, 2, null]})", "index 2 holds null"},
        {R"({"prompt": [1, {"a": 1}]})", "index 1 holds an object"},
        // Never printed (printing this one recursed 10^5 deep), nor built: refused by its depth.
        {R"({"prompt": [1, )" + std::string(100000, '[') + std::string(100000, ']') + "]}",
         "request body nests deeper than 16 levels"},
        {R"({"prompt": [1, [[1]]]})", "index 1 holds an array"},
        {R"({"prompt": [[1], [2]]})", "one prompt per request"},
        {R"({"prompt": [1, 2,]})", "not valid JSON"},
        {R"({"prompt": [01]})", "not valid JSON"},
        {R"({"prompt": [1 2]})", "not valid JSON"},
        {R"({"prompt": [1], "max_tokens": 0})", "'max_tokens'"},
        {R"({"prompt": [1], "max_tokens": tru})", "not valid JSON (in 'max_tokens')"},
        {R"({"prompt": [1], "stream": "yes"})", "'stream'"},
        {R"({"prompt": [1], "model": 5})", "'model' must be a string"},
        {R"({"prompt": "x", "model": ["tiny"]})", "'model' must be a string"},
        {R"({"prompt": [1], "kv_transfer_params": {"remote_block_ids": [-1]}})",
         "kv_transfer_params.remote_block_ids"},
        {R"({"prompt": [1], "kv_transfer_params": {"a": }})", "not valid JSON"},
    };
    for (const auto& [body, words] : cases) {
        auto r = scan_completion_request(body);
        ASSERT_FALSE(r.ok()) << body;
        EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << body;
        EXPECT_NE(r.status().message().find(words), std::string::npos)
            << body << " -> " << r.status().message();
        expect_same_verdict(body);
    }
}

// Peak resident memory of this process since `reset_peak_rss()`, in bytes.
void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }
size_t peak_rss_bytes() {
    std::ifstream in("/proc/self/status");
    for (std::string line; std::getline(in, line);)
        if (line.starts_with("VmHWM:")) return std::stoull(line.substr(6)) * 1024;
    return 0;
}

// A 16 MiB body (the default --max-body-bytes) was built into nlohmann's DOM whole, at 30-50
// times its size: 1.3 million members the API ignores held 600 MB in an engine, 8 million nested
// arrays 870 MB, a number array where a string goes as much, and the memory stayed with the
// process. Now ignored members are checked but not kept, nothing nests deeper than 16 and a
// container where a scalar goes is refused unbuilt: the engines and the router parse such a body
// within a small multiple of its size, with the verdicts they gave before.
TEST(CompletionRelay, SixteenMegabyteBodiesAreParsedWithoutBuildingThemWhole) {
    std::string members = R"({"prompt": [1, 2], "max_tokens": 3)";
    for (int i = 0; members.size() < (15u << 20); ++i) members += fmt::format(R"(,"k{}":0)", i);
    members += "}";
    std::string deep =
        R"({"prompt": [1], "x": )" + std::string(7u << 20, '[') + std::string(7u << 20, ']') + "}";
    std::string wide = R"({"prompt": [1], "model": [1)";
    while (wide.size() < (15u << 20)) wide += ",1";
    wide += "]}";
    struct Case {
        const std::string* body;
        const char* verdict;  // empty: accepted
    };
    for (const Case& c : {Case{&members, ""}, Case{&deep, "nests deeper than 16 levels"},
                          Case{&wide, "'model' must be a string"}}) {
        for (bool router : {false, true}) {
            SCOPED_TRACE(fmt::format("{} of {} bytes, {}", c.body->substr(0, 30), c.body->size(),
                                     router ? "router" : "engine"));
            reset_peak_rss();
            const size_t before = peak_rss_bytes();
            Status st = router ? scan_completion_request(*c.body).status()
                               : parse_completion_request(*c.body).status();
            const size_t after = peak_rss_bytes();
            const size_t grew = after > before ? after - before : 0;
            if (*c.verdict == 0) {
                EXPECT_TRUE(st.ok()) << st.to_string();
            } else {
                EXPECT_NE(st.message().find(c.verdict), std::string::npos) << st.to_string();
            }
            // The router keeps each member's span (~64 bytes of 6 of text): 10x at most.
            EXPECT_LT(grew, 10 * c.body->size()) << grew / 1e6 << " MB more at the peak";
        }
    }
}

TEST(CompletionRelay, UnusualButValidTokenIdsTakeTheFullCheck) {
    for (const char* body :
         {R"({"prompt": [-0, 1]})", R"({"prompt":[ 7 ]})", R"({"prompt": [1], "prompt": [2]})",
          R"({"prompt": 3, "prompt": [2]})", "{\"prompt\":\n[1,\r\n2\t]}",
          R"({"prompt": [1, 2], "prompt": "ab", "max_tokens": 9})",
          R"({"prompt": "ab", "prompt": [30, 4]})", R"({"prompt": [1e1, 2]})"})
        expect_same_verdict(body);
}

// Bodies broken at random places: whatever the damage, the relay and the full parse agree.
TEST(CompletionRelay, RandomlyDamagedBodiesGetTheSameVerdictAsTheFullParse) {
    uint64_t seed = std::random_device{}();
    std::mt19937_64 rng(seed);
    SCOPED_TRACE("seed " + std::to_string(seed));
    const std::string bases[] = {
        R"({"model": "m", "prompt": [12, 7, 300, 0, 99], "max_tokens": 4, "stream": true})",
        R"({"prompt": "a \"text\" [prompt]", "max_tokens": 2, "n": 1})",
        R"({"prompt": [1, 2], "kv_transfer_params": {"do_remote_prefill": true,
            "remote_block_ids": [3, 4], "remote_port": 8100, "transfer_id": "x-1"}})",
    };
    const std::string alphabet = "{}[]\",:0123456789-. \\ntruefalse";
    for (int round = 0; round < 3000; ++round) {
        std::string body = bases[rng() % 3];
        for (int edits = 1 + int(rng() % 2); edits > 0; --edits) {
            size_t at = rng() % body.size();
            char c = alphabet[rng() % alphabet.size()];
            switch (rng() % 3) {
                case 0:
                    body.erase(at, 1);
                    break;
                case 1:
                    body.insert(body.begin() + long(at), c);
                    break;
                default:
                    body[at] = c;
            }
        }
        expect_same_verdict(body);
        if (::testing::Test::HasFailure()) break;
    }
}

TEST(CompletionRelay, A16kTokenPromptIsRelayedByteForByte) {
    std::mt19937_64 rng(1);
    json prompt = json::array();
    for (int i = 0; i < 16384; ++i) prompt.push_back(int(rng() % 151936));
    std::string body = json{{"prompt", prompt}, {"max_tokens", 128}, {"stream", true}}.dump();
    auto r = scan_completion_request(body);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    std::string leg = r->object.with({{"max_tokens", 1}, {"stream", false}});
    EXPECT_NE(leg.find(prompt.dump()), std::string::npos);
    auto parsed = parse_completion_request(leg);
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(parsed->gen.prompt, prompt.get<std::vector<int32_t>>());
    EXPECT_EQ(parsed->gen.max_tokens, 1u);
}

}  // namespace
}  // namespace ferry::serve
