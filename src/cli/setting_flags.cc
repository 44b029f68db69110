#include "cli/setting_flags.h"

#include <cctype>
#include <string>
#include <utility>

namespace ferry::cli {
namespace {

struct SettingFlag {
    std::string_view setting, flag;
    // Also an ordinary word ("provider"): named only where the setting is meant, never
    // replaced in a message's text.
    bool prose = false;
};

// Settings whose flag is the same wherever they appear.
constexpr SettingFlag kFlags[] = {
    // serve::EngineConfig's.
    {"max_num_seqs", "--max-num-seqs"},
    {"max_model_len", "--max-model-len"},
    {"max_num_batched_tokens", "--max-num-batched-tokens"},
    {"prefill_chunk_tokens", "--prefill-chunk"},
    {"push_layer_groups", "--push-layer-groups"},
    {"num_blocks", "--num-blocks"},
    {"block_size", "--block-size"},
    {"time_scale", "--time-scale"},
    {"engine_id", "--engine-id"},
    {"kv_wait_timeout", "--kv-wait-timeout"},
    // serve::CostModel's.
    {"tp", "--tp"},
    {"compute_efficiency", "--compute-efficiency"},
    {"bandwidth_efficiency", "--bandwidth-efficiency"},
    // The KV link's (serve::FabricKvLinkConfig) and its fabric engine's (ferry::EngineConfig).
    {"provider", "--provider", true},
    {"side_port", "--kv-port"},
    {"EngineConfig::rails", "--kv-rails"},
    // serve::RouterConfig's, and the engines' KV mode that a router compares with its own.
    {"RouterConfig::mode", "--mode"},
    {"RouterConfig::engines", "--engines"},
    {"RouterConfig::prefill", "--prefill"},
    {"RouterConfig::decode", "--decode"},
    {"leg_answer_timeout", "--leg-answer-timeout"},
    {"kv_mode", "--kv-mode"},
    // serve::HttpServerOptions'.
    {"max_body_bytes", "--max-body-bytes"},
    {"header_timeout", "--header-timeout"},
    {"body_timeout", "--body-timeout"},
    {"queue_timeout", "--queue-timeout"},
    {"idle_timeout", "--idle-timeout"},
    {"max_connections", "--max-connections"},
    {"max_connections_per_client", "--max-connections-per-client"},
};

std::string_view flag_of(std::string_view setting) {
    for (const SettingFlag& f : kFlags)
        if (f.setting == setting) return f.flag;
    return {};
}

}  // namespace

serve::SettingNames flag_names(std::string_view port_flag, std::string_view threads_flag) {
    return [port = std::string(port_flag),
            threads = std::string(threads_flag)](std::string_view setting) -> std::string {
        if (setting == "port") return port;
        if (setting == "threads") return threads;
        std::string_view flag = flag_of(setting);
        return std::string(flag.empty() ? setting : flag);
    };
}

Status in_flag_names(const Status& s) {
    auto word_char = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
    std::string m = s.message();
    for (const SettingFlag& f : kFlags) {
        if (f.prose) continue;
        std::string_view field = f.setting, flag = f.flag;
        for (size_t at = m.find(field); at != std::string::npos; at = m.find(field, at)) {
            size_t end = at + field.size();
            if ((at > 0 && word_char(m[at - 1])) || (end < m.size() && word_char(m[end]))) {
                at = end;
                continue;
            }
            m.replace(at, field.size(), flag);
            at += flag.size();
        }
    }
    return Status(s.code(), std::move(m));
}

}  // namespace ferry::cli
