// Test helper: one engine per child process, every rank connected to every other, each with
// one registered buffer whose descriptor all ranks know.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ferry/fabric/engine.h"
#include "support/multiproc.h"

namespace ferry::testing {

struct MeshNode {
    std::unique_ptr<TransferEngine> engine;
    std::vector<uint8_t> buf;
    std::unique_ptr<MemoryRegion> mr;
    std::vector<PeerId> peer;            // by rank; own rank unset
    std::vector<MemoryDescriptor> desc;  // by rank, own included
    std::vector<EngineAddress> addr;     // by rank, own included
};

EngineConfig test_engine_config(const std::string& provider);

// Creates the engine, registers a buffer of buf_size bytes filled with `fill`, exchanges
// addresses and descriptors with every rank and connects to all of them. Ranks listed in
// `late` (a peer started later, e.g. a restarted one) take part in the exchange with an empty
// blob instead of calling this, and are left out.
Result<MeshNode> make_mesh_node(Exchange& ex, const EngineConfig& config, size_t buf_size,
                                uint8_t fill, std::span<const int> late = {});

// Providers the engine tests run on.
std::vector<std::string> test_providers();

}  // namespace ferry::testing
