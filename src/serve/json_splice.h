// A JSON object's top-level members kept as spans of its original text, so that a relay can
// set a few fields of a large body without parsing and re-serialising the rest. The router
// uses it to forward /v1/completions bodies whose prompt is many thousand token ids: parsing
// such a prompt into nlohmann::json and dumping it again was most of the router's time.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/common/status.h"

namespace ferry::serve {

struct JsonMember {
    std::string key{};         // decoded
    std::string_view value{};  // the value's text, as it stands in the object
    std::string_view text{};   // "key": value, as it stands in the object
};

// Views into the text it was scanned from, which must outlive it.
struct JsonObjectText {
    std::vector<JsonMember> members{};

    // The last member named `key` (as in nlohmann and most parsers, a later duplicate wins),
    // or nullptr.
    const JsonMember* find(std::string_view key) const;
    // The object with every member of `fields` set: members of other names are copied byte for
    // byte, those named in `fields` are dropped (all duplicates) and `fields` appended.
    std::string with(const nlohmann::json& fields) const;
};

// Splits a JSON object into its members. Checks the object's structure and its keys (a key that
// is not a valid JSON string is an error); values are only delimited, not validated: parse the
// ones you use, check the rest yourself. Errors are kInvalidArgument "not valid JSON: ...".
Result<JsonObjectText> scan_json_object(std::string_view text);

// Parses one value's text strictly; a discarded json (is_discarded()) when it is not valid.
nlohmann::json parse_json_value(std::string_view text);

}  // namespace ferry::serve
