// Operations that time out are reported failed at once, but the provider may still carry
// them out later: memory handed back to its owner after deregistration must never receive
// their late bytes.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "ferry/fabric/engine.h"
#include "support/engine_fixture.h"
#include "support/multiproc.h"

namespace ferry {
namespace {

using testing::Exchange;
using testing::make_mesh_node;
using testing::MeshNode;
using testing::run_processes;

const auto kWait = std::chrono::seconds(20);

class LateCompletionTest : public ::testing::TestWithParam<std::string> {};

// The target process is stopped (SIGSTOP) while a read from it is outstanding: the read times
// out, the initiator deregisters the destination and makes it inaccessible, and the target is
// let go. A late read landing in that memory would kill the initiator (SIGSEGV).
TEST_P(LateCompletionTest, TimedOutReadNeverLandsInDeregisteredMemory) {
    const size_t kLen = 1 << 20;
    const auto kOpTimeout = std::chrono::milliseconds(2000);
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            EngineConfig cfg = testing::test_engine_config(GetParam());
            cfg.op_timeout = kOpTimeout;
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, cfg, kLen, 0x5A));
            CHILD_ASSIGN_OK(std::vector<long> pids, ex.pids());
            if (ex.rank() == 1) {
                CHILD_CHECK(ex.barrier().ok());  // stopped and continued by rank 0 meanwhile
                return "";
            }
            const long target = pids[1];

            void* raw =
                mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            CHILD_CHECK(raw != MAP_FAILED);
            auto* dst = static_cast<uint8_t*>(raw);
            std::memset(dst, 0xCD, kLen);
            CHILD_ASSIGN_OK(auto region, n.engine->register_memory(dst, kLen));
            // The connection exists before the target stops.
            CHILD_CHECK_OK(
                n.engine->read({n.peer[1], region.get(), 0, &n.desc[1], 0, 4096}).wait(kWait));
            CHILD_CHECK(dst[0] == 0x5A);

            CHILD_CHECK_MSG(testing::stop_process(target, std::chrono::seconds(2)),
                            "target {} did not stop", target);
            OpHandle late = n.engine->read({n.peer[1], region.get(), 0, &n.desc[1], 0, kLen});
            Status s = late.wait(kWait);
            // shm may serve the read without the target (CMA); tcp needs the target to answer.
            if (GetParam() == "tcp") {
                CHILD_CHECK_MSG(!s.ok(), "read from a stopped target succeeded");
            }
            std::thread resume([target] {
                std::this_thread::sleep_for(std::chrono::milliseconds(300));
                ::kill(static_cast<pid_t>(target), SIGCONT);
            });
            region.reset();  // deregistration: must wait for the late read
            // Handed back: any later byte written by the provider is a crash.
            CHILD_CHECK(mprotect(dst, kLen, PROT_NONE) == 0);
            resume.join();
            std::this_thread::sleep_for(std::chrono::milliseconds(500));

            // The engine still works afterwards.
            std::vector<uint8_t> fresh(4096, 0);
            CHILD_ASSIGN_OK(auto r2, n.engine->register_memory(fresh.data(), fresh.size()));
            CHILD_CHECK_OK(
                n.engine->read({n.peer[1], r2.get(), 0, &n.desc[1], 0, 4096}).wait(kWait));
            CHILD_CHECK(fresh[4095] == 0x5A);
            munmap(dst, kLen);
            CHILD_CHECK(ex.barrier().ok());
            return "";
        },
        std::chrono::seconds(120));
    EXPECT_EQ(testing::describe_failures(results), "");
}

INSTANTIATE_TEST_SUITE_P(Providers, LateCompletionTest,
                         ::testing::ValuesIn(testing::test_providers()));

}  // namespace
}  // namespace ferry
