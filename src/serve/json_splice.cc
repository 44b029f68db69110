#include "serve/json_splice.h"

#include <fmt/format.h>

namespace ferry::serve {

using nlohmann::json;

json parse_json_value(std::string_view text) {
    return json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
}

namespace {

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// Walks an object's text; each step either advances or reports where the text went wrong.
struct Scanner {
    std::string_view text;
    size_t pos = 0;

    bool at_end() const { return pos >= text.size(); }
    char peek() const { return at_end() ? '\0' : text[pos]; }
    void skip_ws() {
        while (!at_end() && is_ws(text[pos])) ++pos;
    }
    Status error(std::string_view what) const {
        return invalid_argument(fmt::format("not valid JSON: {} at byte {}", what, pos));
    }
    // From an opening quote past the closing one; escapes are skipped, not decoded.
    bool skip_string() {
        for (++pos; !at_end(); ++pos) {
            if (text[pos] == '\\')
                ++pos;
            else if (text[pos] == '"')
                return ++pos, true;
        }
        return false;
    }
    // Past one value. Containers are matched by depth only (strings inside them skipped), and
    // scalars run to the next delimiter: what lies between is for the value's parser to judge.
    bool skip_value() {
        char c = peek();
        if (c == '"') return skip_string();
        if (c == '{' || c == '[') {
            int depth = 0;
            while (!at_end()) {
                char d = text[pos];
                if (d == '"') {
                    if (!skip_string()) return false;
                    continue;
                }
                ++pos;
                if (d == '{' || d == '[') ++depth;
                if ((d == '}' || d == ']') && --depth == 0) return true;
            }
            return false;
        }
        size_t start = pos;
        while (!at_end() && !is_ws(text[pos]) && text[pos] != ',' && text[pos] != '}' &&
               text[pos] != ']')
            ++pos;
        return pos > start;
    }
};

}  // namespace

Result<JsonObjectText> scan_json_object(std::string_view text) {
    Scanner s{text};
    JsonObjectText out;
    s.skip_ws();
    if (s.peek() != '{') return s.error("expected an object");
    ++s.pos;
    s.skip_ws();
    if (s.peek() == '}') {
        ++s.pos;
    } else {
        while (true) {
            size_t member_start = s.pos;
            if (s.peek() != '"' || !s.skip_string()) return s.error("expected a member name");
            json key = parse_json_value(text.substr(member_start, s.pos - member_start));
            if (!key.is_string()) return s.error("invalid member name");
            s.skip_ws();
            if (s.peek() != ':') return s.error("expected ':'");
            ++s.pos;
            s.skip_ws();
            size_t value_start = s.pos;
            if (!s.skip_value()) return s.error("unterminated value");
            out.members.push_back({key.get<std::string>(),
                                   text.substr(value_start, s.pos - value_start),
                                   text.substr(member_start, s.pos - member_start)});
            s.skip_ws();
            if (s.peek() == '}') {
                ++s.pos;
                break;
            }
            if (s.peek() != ',') return s.error("expected ',' or '}'");
            ++s.pos;
            s.skip_ws();
        }
    }
    s.skip_ws();
    if (!s.at_end()) return s.error("text after the object");
    return out;
}

const JsonMember* JsonObjectText::find(std::string_view key) const {
    for (auto it = members.rbegin(); it != members.rend(); ++it)
        if (it->key == key) return &*it;
    return nullptr;
}

std::string JsonObjectText::with(const json& fields) const {
    std::vector<std::string> added;
    size_t size = 2;
    for (const auto& [key, value] : fields.items()) {
        added.push_back(json(key).dump() + ":" + value.dump());
        size += added.back().size() + 1;
    }
    for (const JsonMember& m : members) size += m.text.size() + 1;
    std::string out;
    out.reserve(size);
    out += '{';
    auto append = [&out](std::string_view member) {
        if (out.size() > 1) out += ',';
        out += member;
    };
    for (const JsonMember& m : members)
        if (!fields.contains(m.key)) append(m.text);
    for (const std::string& a : added) append(a);
    out += '}';
    return out;
}

}  // namespace ferry::serve
