// The handshake's wire (private to src/kv): frame constants, the proofs both sides compute,
// and the socket helpers server and client share. docs/PROTOCOL.md has the frames.
#pragma once

#include <unistd.h>

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/fd.h"
#include "ferry/common/auth.h"
#include "ferry/common/bytes.h"
#include "ferry/common/clock.h"
#include "ferry/common/status.h"

namespace ferry::kv::handshake_wire {

inline constexpr uint32_t kInfoMagic = 0x4652484e;     // "FRHN"
inline constexpr uint32_t kRequestMagic = 0x46524851;  // "FRHQ"
inline constexpr uint32_t kReplyMagic = 0x46524852;    // "FRHR"
inline constexpr uint32_t kMaxFrame = 64 * 1024;
// Client frames are small and fixed (HELLO 39, AUTH 47 bytes); anything bigger is refused
// before it is read, so a client cannot make the server buffer much.
inline constexpr uint32_t kMaxClientFrame = 256;
inline constexpr int kPollMs = 50;  // how soon stop() is seen
inline constexpr size_t kNonceBytes = 32;
using Nonce = std::array<uint8_t, kNonceBytes>;

enum class Frame : uint8_t { kHello = 1, kChallenge = 2, kAuth = 3, kAnswer = 4, kRefused = 5 };
inline constexpr const char* kAuthFailed = "authentication failed";

// HMAC under the secret over a domain label, both nonces and `extra`: the label keeps a
// server's proof from passing as a client's, the nonces make every exchange unique.
Digest proof(const Secret& secret, std::string_view label, const Nonce& client, const Nonce& server,
             std::span<const uint8_t> extra = {});
inline constexpr std::string_view kServerLabel = "ferry-handshake-v2 server";
inline constexpr std::string_view kClientLabel = "ferry-handshake-v2 client";
inline constexpr std::string_view kAnswerLabel = "ferry-handshake-v2 answer";

int ms_left(TimePoint deadline);

Status wait_fd(int fd, short events, TimePoint deadline, const char* what);

Status send_all(int fd, const uint8_t* p, size_t n, TimePoint deadline);

Status recv_all(int fd, uint8_t* p, size_t n, TimePoint deadline);

// One send per frame: a length and a payload sent apart made Nagle hold the payload until
// the peer's delayed ACK, 40 ms per frame (a handshake took 45 ms instead of under 1 ms).
Status send_frame(int fd, std::span<const uint8_t> payload, TimePoint deadline);

Result<std::vector<uint8_t>> recv_frame(int fd, TimePoint deadline);

Status check_header(ByteReader& r, uint32_t magic, const char* what);

// `refused` (optional) is set when every address refused the connection: nothing listens there.
Result<Fd> connect_to(const std::string& host, uint16_t port, TimePoint deadline,
                      bool* refused = nullptr);

std::string endpoint_key(const std::string& host, uint16_t port);

}  // namespace ferry::kv::handshake_wire
