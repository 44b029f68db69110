#include "ferry/serve/openai_api.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace ferry::serve
