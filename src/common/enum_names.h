// One way to name an enum's values: a table of {value, name} pairs beside the enum's code,
// read by name_of (value -> name), parse_name (name -> value) and name_list (the accepted
// names, for an error message), instead of a switch and a parse loop per enum. Names are
// string literals, so name_of(...).data() is NUL-terminated where a const char* is wanted.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace ferry {

template <typename E>
struct EnumName {
    E value;
    std::string_view name;
};

// The name of `value`; `unknown` for a value the table lacks (a value cast from a wire byte).
template <typename E, size_t N>
constexpr std::string_view name_of(const EnumName<E> (&table)[N], E value,
                                   std::string_view unknown = "unknown") {
    for (const EnumName<E>& e : table)
        if (e.value == value) return e.name;
    return unknown;
}

// The value named `name` exactly; several names may map to one value (aliases: the first
// listed is what name_of gives).
template <typename E, size_t N>
constexpr std::optional<E> parse_name(const EnumName<E> (&table)[N], std::string_view name) {
    for (const EnumName<E>& e : table)
        if (e.name == name) return e.value;
    return std::nullopt;
}

// "a, b or c": every name of the table, in order.
template <typename E, size_t N>
std::string name_list(const EnumName<E> (&table)[N]) {
    std::string out;
    for (size_t i = 0; i < N; ++i) {
        if (i > 0) out += i + 1 == N ? " or " : ", ";
        out += table[i].name;
    }
    return out;
}

}  // namespace ferry
