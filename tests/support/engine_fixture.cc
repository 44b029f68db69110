#include "support/engine_fixture.h"

#include <algorithm>
#include <cstring>

#include "ferry/common/bytes.h"

namespace ferry::testing {

EngineConfig test_engine_config(const std::string& provider) {
    EngineConfig c;
    c.provider = provider;
    c.op_timeout = std::chrono::seconds(5);
    // Tests run many engines on a 2-core machine: nap early rather than spin.
    c.idle_spin = std::chrono::microseconds(50);
    return c;
}

std::vector<std::string> test_providers() { return {"tcp", "shm"}; }

Result<MeshNode> make_mesh_node(Exchange& ex, const EngineConfig& config, size_t buf_size,
                                uint8_t fill, std::span<const int> late) {
    MeshNode n;
    FERRY_ASSIGN_OR_RETURN(n.engine, TransferEngine::create(config));
    n.buf.assign(buf_size, fill);
    FERRY_ASSIGN_OR_RETURN(n.mr, n.engine->register_memory(n.buf.data(), n.buf.size()));
    ByteWriter w;
    n.engine->address().encode(w);
    n.mr->descriptor().encode(w);
    FERRY_ASSIGN_OR_RETURN(auto all, ex.allgather(w.bytes()));
    n.peer.assign(ex.size(), 0);
    n.desc.resize(ex.size());
    n.addr.resize(ex.size());
    for (int r = 0; r < ex.size(); ++r) {
        if (std::find(late.begin(), late.end(), r) != late.end()) continue;
        if (all[r].empty()) return unavailable("rank " + std::to_string(r) + " is gone");
        ByteReader rd(all[r]);
        FERRY_ASSIGN_OR_RETURN(n.addr[r], EngineAddress::decode(rd));
        FERRY_ASSIGN_OR_RETURN(n.desc[r], MemoryDescriptor::decode(rd));
        if (r == ex.rank()) continue;
        FERRY_ASSIGN_OR_RETURN(n.peer[r], n.engine->connect(n.addr[r]));
    }
    return n;
}

}  // namespace ferry::testing
