#include "ferry/fabric/types.h"

#include <fmt/format.h>

#include "ferry/common/bytes.h"

namespace ferry {
namespace {

constexpr uint32_t kDescriptorMagic = 0x46524d44;  // "FRMD"
constexpr uint32_t kAddressMagic = 0x46524541;     // "FREA"
constexpr size_t kMaxRails = 64;
constexpr size_t kMaxAddrLen = 1024;

Status check_header(ByteReader& r, uint32_t magic, uint16_t version, const char* what) {
    uint32_t m = 0;
    uint16_t v = 0;
    FERRY_RETURN_IF_ERROR(r.get(&m, "magic"));
    if (m != magic) {
        return protocol_error(
            fmt::format("not a ferry {} (magic {:#x}, expected {:#x})", what, m, magic));
    }
    FERRY_RETURN_IF_ERROR(r.get(&v, "version"));
    if (v != version) {
        return protocol_error(fmt::format(
            "{} version {} is not supported by this build (version {}); upgrade both sides", what,
            v, version));
    }
    return ok_status();
}

}  // namespace

void MemoryDescriptor::encode(ByteWriter& w) const {
    w.put(kDescriptorMagic);
    w.put(kVersion);
    w.put(engine_id);
    w.put(base);
    w.put(length);
    w.put(static_cast<uint8_t>(kind));
    w.put(device);
    w.put(static_cast<uint8_t>(virt_addr));
    w.put_vector(rail_keys);
    w.put(rail_mask);
    w.put(near_mask);
    w.put(static_cast<uint8_t>(has_ipc));
    if (has_ipc) {
        w.put(ipc_handle);
        w.put(ipc_offset);
        w.put(ipc_pid);
    }
    w.put(cma_pid);
    if (cma_pid) {
        w.put(cma_pid_ns);
        w.put(cma_start);
        w.put(cma_fence_fd);
        w.put(cma_fence_slot);
        w.put(cma_fence_gen);
    }
}

Result<MemoryDescriptor> MemoryDescriptor::decode(ByteReader& r) {
    FERRY_RETURN_IF_ERROR(check_header(r, kDescriptorMagic, kVersion, "memory descriptor"));
    MemoryDescriptor d;
    uint8_t kind = 0, virt = 0;
    FERRY_RETURN_IF_ERROR(r.get(&d.engine_id, "engine_id"));
    FERRY_RETURN_IF_ERROR(r.get(&d.base, "base"));
    FERRY_RETURN_IF_ERROR(r.get(&d.length, "length"));
    FERRY_RETURN_IF_ERROR(r.get(&kind, "kind"));
    FERRY_RETURN_IF_ERROR(r.get(&d.device, "device"));
    FERRY_RETURN_IF_ERROR(r.get(&virt, "virt_addr"));
    FERRY_RETURN_IF_ERROR(r.get_vector(&d.rail_keys, "rail_keys", kMaxRails));
    FERRY_RETURN_IF_ERROR(r.get(&d.rail_mask, "rail_mask"));
    FERRY_RETURN_IF_ERROR(r.get(&d.near_mask, "near_mask"));
    uint8_t ipc = 0;
    FERRY_RETURN_IF_ERROR(r.get(&ipc, "has_ipc"));
    d.has_ipc = ipc != 0;
    if (d.has_ipc) {
        FERRY_RETURN_IF_ERROR(r.get(&d.ipc_handle, "ipc_handle"));
        FERRY_RETURN_IF_ERROR(r.get(&d.ipc_offset, "ipc_offset"));
        FERRY_RETURN_IF_ERROR(r.get(&d.ipc_pid, "ipc_pid"));
    }
    FERRY_RETURN_IF_ERROR(r.get(&d.cma_pid, "cma_pid"));
    if (d.cma_pid < 0) {
        return protocol_error(
            fmt::format("memory descriptor has a negative cma_pid {}", d.cma_pid));
    }
    if (d.cma_pid) {
        FERRY_RETURN_IF_ERROR(r.get(&d.cma_pid_ns, "cma_pid_ns"));
        FERRY_RETURN_IF_ERROR(r.get(&d.cma_start, "cma_start"));
        FERRY_RETURN_IF_ERROR(r.get(&d.cma_fence_fd, "cma_fence_fd"));
        FERRY_RETURN_IF_ERROR(r.get(&d.cma_fence_slot, "cma_fence_slot"));
        FERRY_RETURN_IF_ERROR(r.get(&d.cma_fence_gen, "cma_fence_gen"));
        if (d.cma_fence_fd < 0 || d.cma_fence_slot == 0 || (d.cma_fence_gen & 1) == 0) {
            return protocol_error(fmt::format(
                "memory descriptor offers process_vm_writev without a fence (fd {}, slot {}, "
                "generation {})",
                d.cma_fence_fd, d.cma_fence_slot, d.cma_fence_gen));
        }
    }
    if (kind > static_cast<uint8_t>(MemoryKind::kCuda)) {
        return protocol_error(fmt::format("memory descriptor has unknown memory kind {}", kind));
    }
    if (d.rail_keys.empty() && !d.has_ipc) {
        return protocol_error("memory descriptor has neither rail keys nor a CUDA IPC handle");
    }
    if (!d.rail_keys.empty() && d.held_rails() == 0) {
        return protocol_error(fmt::format(
            "memory descriptor has {} rail keys but its rail mask {:#x} names none of them",
            d.rail_keys.size(), d.rail_mask));
    }
    if (!d.rail_keys.empty() && (d.near_mask & d.held_rails()) == 0) {
        return protocol_error(fmt::format(
            "memory descriptor's near mask {:#x} names none of the rails holding the region "
            "(rail mask {:#x}, {} rail keys)",
            d.near_mask, d.rail_mask, d.rail_keys.size()));
    }
    d.kind = static_cast<MemoryKind>(kind);
    d.virt_addr = virt != 0;
    return d;
}

std::vector<uint8_t> MemoryDescriptor::serialize() const {
    ByteWriter w;
    encode(w);
    return w.take();
}

Result<MemoryDescriptor> MemoryDescriptor::deserialize(std::span<const uint8_t> blob) {
    ByteReader r(blob);
    return decode(r);
}

void EngineAddress::encode(ByteWriter& w) const {
    w.put(kAddressMagic);
    w.put(kVersion);
    w.put(engine_id);
    w.put_string(provider);
    w.put_string(host_id);
    w.put<uint32_t>(static_cast<uint32_t>(rail_addrs.size()));
    for (const auto& a : rail_addrs) w.put_bytes(a);
    signal.encode(w);
}

Result<EngineAddress> EngineAddress::decode(ByteReader& r) {
    FERRY_RETURN_IF_ERROR(check_header(r, kAddressMagic, kVersion, "engine address"));
    EngineAddress a;
    FERRY_RETURN_IF_ERROR(r.get(&a.engine_id, "engine_id"));
    FERRY_RETURN_IF_ERROR(r.get_string(&a.provider, "provider", 256));
    FERRY_RETURN_IF_ERROR(r.get_string(&a.host_id, "host_id", 256));
    uint32_t n = 0;
    FERRY_RETURN_IF_ERROR(r.get(&n, "rail count"));
    if (n == 0 || n > kMaxRails) {
        return protocol_error(
            fmt::format("engine address has {} rails (1..{} allowed)", n, kMaxRails));
    }
    a.rail_addrs.resize(n);
    for (auto& ra : a.rail_addrs) {
        FERRY_RETURN_IF_ERROR(r.get_bytes(&ra, "rail address", kMaxAddrLen));
    }
    FERRY_ASSIGN_OR_RETURN(a.signal, MemoryDescriptor::decode(r));
    return a;
}

std::vector<uint8_t> EngineAddress::serialize() const {
    ByteWriter w;
    encode(w);
    return w.take();
}

Result<EngineAddress> EngineAddress::deserialize(std::span<const uint8_t> blob) {
    ByteReader r(blob);
    return decode(r);
}

std::string to_hex(std::span<const uint8_t> bytes) {
    static const char* digits = "0123456789abcdef";
    std::string s;
    s.reserve(bytes.size() * 2);
    for (uint8_t b : bytes) {
        s.push_back(digits[b >> 4]);
        s.push_back(digits[b & 15]);
    }
    return s;
}

Result<std::vector<uint8_t>> from_hex(std::string_view text) {
    if (text.size() % 2) return invalid_argument("hex text has an odd number of digits");
    auto val = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        return -1;
    };
    std::vector<uint8_t> out(text.size() / 2);
    for (size_t i = 0; i < out.size(); ++i) {
        int hi = val(text[2 * i]), lo = val(text[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            return invalid_argument(fmt::format("hex text has a non-hex character at {}", 2 * i));
        }
        out[i] = static_cast<uint8_t>(hi << 4 | lo);
    }
    return out;
}

}  // namespace ferry
