#include "serve/json_splice.h"

#include <gtest/gtest.h>

#include <random>

namespace ferry::serve {
namespace {

using nlohmann::json;

JsonObjectText scan(std::string_view text) {
    auto r = scan_json_object(text);
    EXPECT_TRUE(r.ok()) << text << ": " << r.status().to_string();
    return r.ok() ? std::move(r).value() : JsonObjectText{};
}

TEST(JsonSplice, MembersAreTheirOriginalTextWithDecodedKeys) {
    std::string text =
        " {\"a\" : [1, {\"x\": \"]}\\\"[\"}],\n\"b\":\"q\\\"}\", \"pro\\u006dpt\" :17 ,\"e\":{}}\t";
    JsonObjectText o = scan(text);
    ASSERT_EQ(o.members.size(), 4u);
    EXPECT_EQ(o.members[0].key, "a");
    EXPECT_EQ(o.members[0].value, R"([1, {"x": "]}\"["}])");
    EXPECT_EQ(o.members[1].value, R"("q\"}")");
    EXPECT_EQ(o.members[2].key, "prompt");
    EXPECT_EQ(o.members[2].text, "\"pro\\u006dpt\" :17");
    EXPECT_EQ(o.members[3].value, "{}");
    EXPECT_EQ(scan("{}").members.size(), 0u);
    EXPECT_EQ(scan(" { } ").members.size(), 0u);
}

TEST(JsonSplice, WithSetsFieldsAndCopiesTheRestByteForByte) {
    std::string prompt = "[1,  2,3 ,\n4]";
    std::string text = R"({"prompt": )" + prompt +
                       R"(, "stream": true, "kv_transfer_params": {"do_remote_decode": true,
        "remote_block_ids": [1, 2]}, "model": "m", "stream": false})";
    JsonObjectText o = scan(text);
    std::string out = o.with({{"stream", false}, {"kv_transfer_params", {{"transfer_id", "t"}}}});
    EXPECT_NE(out.find(R"("prompt": )" + prompt), std::string::npos) << out;
    json j = json::parse(out);
    // Every duplicate of a set field is gone, nested client values included.
    EXPECT_EQ(j, json::parse(R"({"prompt": [1, 2, 3, 4], "model": "m", "stream": false,
                                 "kv_transfer_params": {"transfer_id": "t"}})"));
    EXPECT_EQ(out.find("remote_block_ids"), std::string::npos) << out;
    EXPECT_EQ(scan("{}").with({{"a", 1}}), R"({"a":1})");
    EXPECT_EQ(o.find("stream")->value, "false");  // the last duplicate, as parsers read it
    EXPECT_EQ(o.find("nope"), nullptr);
}

TEST(JsonSplice, MalformedObjectsAreRefusedWithWhereTheyWentWrong) {
    for (std::string_view bad :
         {"", "   ", "[1]", "\"s\"", "{", "{\"a\"", "{\"a\":", "{\"a\":1", "{\"a\" 1}", "{a:1}",
          "{\"a\":1,}", "{,}", "{\"a\":1}x", "{\"a\":1}{}", "{\"a\":[1,2}", "{\"a\":\"x}",
          "{\"a\":{\"b\":1}", "{\"\\x\":1}", "{\"a\":1 \"b\":2}"}) {
        auto r = scan_json_object(bad);
        ASSERT_FALSE(r.ok()) << bad;
        EXPECT_NE(r.status().message().find("not valid JSON"), std::string::npos) << bad;
        EXPECT_NE(r.status().message().find("at byte"), std::string::npos) << bad;
    }
}

// Random JSON values, objects nested in arrays and objects, strings with quotes, brackets and
// escapes: what a scan must step over without being fooled.
json random_value(std::mt19937_64& rng, int depth) {
    auto pick = [&](int n) { return int(std::uniform_int_distribution<int>(0, n - 1)(rng)); };
    static const char* strings[] = {"", "x", "]}", "{[\"", "\\", "a\"b", "\n\t", "é€😀", ",:"};
    switch (depth > 2 ? pick(5) : pick(7)) {
        case 0:
            return nullptr;
        case 1:
            return pick(2) == 1;
        case 2:
            return pick(2000000) - 1000000;
        case 3:
            return double(pick(1000)) / 7;
        case 4:
            return strings[pick(9)];
        case 5: {
            json a = json::array();
            for (int i = pick(5); i > 0; --i) a.push_back(random_value(rng, depth + 1));
            return a;
        }
        default: {
            json o = json::object();
            for (int i = pick(5); i > 0; --i) o[strings[pick(9)]] = random_value(rng, depth + 1);
            return o;
        }
    }
}

TEST(JsonSplice, RandomObjectsScanToTheirMembersAndSpliceLikeUpdate) {
    uint64_t seed = std::random_device{}();
    std::mt19937_64 rng(seed);
    SCOPED_TRACE("seed " + std::to_string(seed));
    for (int round = 0; round < 500; ++round) {
        json o = json::object();
        for (int i = int(rng() % 6); i > 0; --i)
            o["k" + std::to_string(rng() % 8)] = random_value(rng, 0);
        int indent = int(rng() % 3) - 1;  // -1: compact
        std::string text = o.dump(indent);
        JsonObjectText s = scan(text);
        ASSERT_EQ(s.members.size(), o.size()) << text;
        for (const JsonMember& m : s.members) EXPECT_EQ(json::parse(m.value), o[m.key]) << text;
        json fields = {{"k" + std::to_string(rng() % 8), random_value(rng, 0)}, {"new", 1}};
        json expected = o;
        expected.update(fields);
        EXPECT_EQ(json::parse(s.with(fields)), expected) << text;
    }
}

}  // namespace
}  // namespace ferry::serve
