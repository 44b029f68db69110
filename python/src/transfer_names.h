// A KV connector's transfers named by the engine's own ids. vLLM names requests by strings; a
// connector had to keep its own map to ferry's 64-bit ids. Here a str (UTF-8) or bytes id
// becomes kv::transfer_key(id), which both sides of a transfer compute alike without another
// message, and the name is kept while the transfer is open on this connector: its events carry
// it back (KvEvent.request_id), and a second name with the same 64 bits is refused instead of
// being mixed with the first. An int id is its own key, as before.
// Touched only with the GIL held (every binding call holds it on entry), so no lock.
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <string>
#include <unordered_map>

#include "convert.h"
#include "errors.h"
#include "ferry/kv/transfer_key.h"

namespace ferry::python {

class TransferNames {
  public:
    // The events that end a transfer's part on this connector: each open part is one such
    // event to come.
    enum Part : uint8_t { kScheduled = 0, kRecv = 1, kSend = 2, kParts = 3 };

    // What hold() took, for release() when the call it was for is refused.
    struct Hold {
        uint64_t key = 0;
        bool named = false;
        bool added = false;
        Part part = kRecv;
    };

    static const char* part_event(Part p) {
        return p == kScheduled ? "scheduled" : p == kRecv ? "recv" : "send";
    }

    // The key of `id` (an int already checked to fit 64 bits, a str, or bytes), holding
    // nothing: cancel() and abort_send() of a name never used here are no-ops, as for ints.
    uint64_t key(pybind11::handle id) const {
        if (PyLong_Check(id.ptr())) return id.cast<uint64_t>();
        std::string name = bytes_of(id);
        uint64_t k = kv::transfer_key(name);
        refuse_collision(k, name, id);
        return k;
    }

    // The key of `id`; a name is kept until `part`'s event was polled. `once`: the part has
    // one event however often it is held (prefill's calls); otherwise one event per hold
    // (each register_push, pull or announce ends in its own event).
    Hold hold(pybind11::handle id, Part part, bool once) {
        Hold h;
        h.part = part;
        h.key = key(id);
        if (PyLong_Check(id.ptr())) return h;
        h.named = true;
        Name& n = names_[h.key];
        if (!n.id) {
            n.id = pybind11::reinterpret_borrow<pybind11::object>(id);
            n.bytes = bytes_of(id);
        }
        if (!once || n.open[part] == 0) {
            n.open[part]++;
            h.added = true;
        }
        return h;
    }

    // Undoes hold() for a call that was refused.
    void release(const Hold& h) {
        if (h.named && h.added) close_part(h.key, h.part);
    }

    // The name of an event's transfer (a null object for an int id); an event that ends a
    // part drops one hold of it.
    pybind11::object on_event(uint64_t key, const std::string& kind) {
        auto it = names_.find(key);
        if (it == names_.end()) return pybind11::object();
        pybind11::object id = it->second.id;
        for (uint8_t p = 0; p < kParts; ++p) {
            if (kind == part_event(static_cast<Part>(p))) close_part(key, static_cast<Part>(p));
        }
        return id;
    }

    size_t size() const { return names_.size(); }

  private:
    struct Name {
        pybind11::object id;  // as the caller gave it: str or bytes
        std::string bytes;
        std::array<uint32_t, kParts> open{};
    };

    static std::string bytes_of(pybind11::handle id) {
        if (PyUnicode_Check(id.ptr())) return id.cast<std::string>();  // UTF-8
        std::vector<uint8_t> b = bytes_arg(id, "transfer_id");
        return {b.begin(), b.end()};
    }

    void refuse_collision(uint64_t k, const std::string& name, pybind11::handle id) const {
        auto it = names_.find(k);
        if (it == names_.end() || it->second.bytes == name) return;
        throw StatusError(invalid_argument(
            "transfer id " + std::string(pybind11::repr(id)) + " has the same 64-bit key (" +
            std::to_string(k) + ") as transfer " + std::string(pybind11::repr(it->second.id)) +
            ", open on this connector; refused so that the two cannot mix: use another id"));
    }

    void close_part(uint64_t key, Part part) {
        auto it = names_.find(key);
        if (it == names_.end() || it->second.open[part] == 0) return;
        it->second.open[part]--;
        for (uint32_t n : it->second.open) {
            if (n > 0) return;
        }
        names_.erase(it);
    }

    std::unordered_map<uint64_t, Name> names_;
};

}  // namespace ferry::python
