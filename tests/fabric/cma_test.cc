// Same-host host memory written by the initiator with process_vm_writev (EngineConfig::
// cma_writes) between real processes over shm: bytes intact, nothing outside the region
// touched, the immediate after the bytes, shm's path for a peer that refuses it, and the
// switches that turn it off.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ferry/common/bytes.h"
#include "ferry/common/log.h"
#include "ferry/fabric/engine.h"
#include "support/byte_pattern.h"
#include "support/engine_fixture.h"
#include "support/multiproc.h"

namespace ferry {
namespace {

using testing::check_fill;
using testing::compare_bytes;
using testing::Exchange;
using testing::fill_pattern;
using testing::run_processes;

constexpr uint8_t kPoison = 0xCD;
constexpr size_t kRegion = 4 << 20;
constexpr size_t kGuard = 64 << 10;  // poisoned bytes on each side of the registered region
constexpr uint32_t kImm = 0x43;
const auto kRunTimeout = std::chrono::seconds(120);
const auto kWait = std::chrono::seconds(20);

EngineConfig cma_config() {
    EngineConfig c = testing::test_engine_config("shm");
    c.cma_writes = true;
    return c;
}

// One side of a pair: an engine and a registered region [kGuard, kGuard + kRegion) of `buf`,
// whose guards are never registered, and the other side's address and descriptor.
struct Side {
    std::unique_ptr<TransferEngine> engine;
    std::vector<uint8_t> buf;
    std::unique_ptr<MemoryRegion> mr;
    PeerId peer = 0;
    MemoryDescriptor theirs;
    std::span<uint8_t> region() { return {buf.data() + kGuard, kRegion}; }
};

Result<Side> make_side(Exchange& ex, const EngineConfig& config) {
    Side s;
    FERRY_ASSIGN_OR_RETURN(s.engine, TransferEngine::create(config));
    s.buf.assign(kRegion + 2 * kGuard, kPoison);
    FERRY_ASSIGN_OR_RETURN(s.mr, s.engine->register_memory(s.buf.data() + kGuard, kRegion));
    ByteWriter w;
    s.engine->address().encode(w);
    s.mr->descriptor().encode(w);
    FERRY_ASSIGN_OR_RETURN(auto all, ex.allgather(w.bytes()));
    const int other = 1 - ex.rank();
    if (all[other].empty()) return unavailable("the other side is gone");
    ByteReader rd(all[other]);
    FERRY_ASSIGN_OR_RETURN(EngineAddress addr, EngineAddress::decode(rd));
    FERRY_ASSIGN_OR_RETURN(s.theirs, MemoryDescriptor::decode(rd));
    FERRY_ASSIGN_OR_RETURN(s.peer, s.engine->connect(addr));
    return s;
}

// The initiator tells the target how many immediates to count; the target counts them and
// checks what landed, at once: the bytes must be there when the immediate is.
Status send_count(Exchange& ex, uint32_t n) {
    ByteWriter w;
    w.put(n);
    return ex.allgather(w.bytes()).status();
}
Result<uint32_t> receive_count(Exchange& ex) {
    FERRY_ASSIGN_OR_RETURN(auto all, ex.allgather({}));
    if (all[0].size() != 4) return unavailable("the initiator sent no count");
    uint32_t n = 0;
    std::memcpy(&n, all[0].data(), 4);
    return n;
}

std::string guards_intact(const Side& s) {
    std::string a = check_fill(s.buf, 0, kGuard, kPoison);
    if (!a.empty()) return "guard before the region: " + a;
    std::string b = check_fill(s.buf, kGuard + kRegion, kGuard, kPoison);
    return b.empty() ? "" : "guard after the region: " + b;
}

// Single writes of 1 B to 64 KiB and one write_runs of 2500 runs (more than one system call
// takes), each with the immediate, into a poisoned region: every byte arrives, nothing else is
// touched, the immediates count one per operation and come after their bytes, and only the
// single writes of at most inject_size went through the provider.
TEST(CmaWrites, BytesArriveIntactAndTheImmediateComesAfterThem) {
    const uint64_t seed = testing::test_seed("CmaWrites");
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(Side s, make_side(ex, cma_config()));
            CHILD_CHECK(s.mr->descriptor().cma_pid == static_cast<int32_t>(::getpid()));
            // Disjoint destinations: single writes in the first half, runs in the second.
            std::mt19937_64 rng(seed);
            struct Plan {
                uint64_t src, dst, len;
            };
            std::vector<Plan> singles;
            const uint64_t half = kRegion / 2, slot = half / 32;
            for (uint64_t i = 0; i < 32; ++i) {
                const uint64_t lens[] = {1, 64, 4096, 65536, slot};
                const uint64_t len = lens[i % 5];
                singles.push_back({rng() % (kRegion - len), i * slot, len});
            }
            std::vector<WriteRun> runs;
            const uint64_t kRuns = 2500;
            for (uint64_t i = 0; i < kRuns; ++i) {
                const uint64_t len = 1 + rng() % (half / kRuns);
                runs.push_back({rng() % (kRegion - len), half + i * (half / kRuns), len});
            }
            if (ex.rank() == 0) {
                fill_pattern(s.region(), seed);
                uint32_t imms = 0;
                // Single writes of at most inject_size stay shm's (op_builder.cc).
                const uint64_t inject = s.engine->inject_size();
                uint64_t bytes = 0, through_shm = 0;
                for (const Plan& p : singles) {
                    OpHandle h =
                        s.engine->write({s.peer, s.mr.get(), p.src, &s.theirs, p.dst, p.len, kImm});
                    CHILD_CHECK_OK(h.wait(kWait));
                    imms += h.imm_writes();
                    (p.len > inject ? bytes : through_shm) += p.len;
                }
                CHILD_CHECK(bytes > 0 && through_shm > 0);
                OpHandle h = s.engine->write_runs({s.peer, s.mr.get(), &s.theirs, runs, kImm});
                CHILD_CHECK_OK(h.wait(kWait));
                CHILD_CHECK_MSG(h.imm_writes() == 1, "{} immediates for one write_runs",
                                h.imm_writes());
                imms += h.imm_writes();
                for (const WriteRun& r : runs) bytes += r.length;
                const EngineStats st = s.engine->stats();
                CHILD_CHECK_MSG(st.cma_bytes == bytes, "{} bytes copied by CMA of {}", st.cma_bytes,
                                bytes);
                CHILD_CHECK_MSG(st.bytes_posted == through_shm,
                                "{} bytes went through the provider, not {}", st.bytes_posted,
                                through_shm);
                CHILD_CHECK_OK(send_count(ex, imms));
            } else {
                CHILD_ASSIGN_OK(uint32_t expect, receive_count(ex));
                CHILD_CHECK(expect == singles.size() + 1);
                CHILD_CHECK_OK(s.engine->wait_imm(kImm, expect, kWait));
                std::vector<uint8_t> src(kRegion), want(kRegion, kPoison);
                fill_pattern(src, seed);
                for (const Plan& p : singles)
                    std::memcpy(want.data() + p.dst, src.data() + p.src, p.len);
                for (const WriteRun& r : runs)
                    std::memcpy(want.data() + r.dst_offset, src.data() + r.src_offset, r.length);
                std::string diff = compare_bytes(s.region(), want);
                CHILD_CHECK_MSG(diff.empty(), "{}", diff);
                std::string guards = guards_intact(s);
                CHILD_CHECK_MSG(guards.empty(), "{}", guards);
                CHILD_CHECK(s.engine->imm_available(kImm) == 0);
            }
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

// A paged write (a KV segment's pages: random pages of 1 KiB, some adjacent on both sides) is
// copied by the initiator too, with one immediate after its bytes; none goes through shm.
TEST(CmaWrites, PagedWritesAreCopiedByTheInitiatorWithOneImmediate) {
    const uint64_t seed = testing::test_seed("CmaWrites.Paged");
    constexpr uint64_t kPage = 1024;
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(Side s, make_side(ex, cma_config()));
            std::mt19937_64 rng(seed);
            const uint32_t pages = kRegion / kPage;
            std::vector<uint32_t> dst_ids(pages);
            for (uint32_t i = 0; i < pages; ++i) dst_ids[i] = i;
            std::shuffle(dst_ids.begin(), dst_ids.end(), rng);
            dst_ids.resize(pages / 2);
            std::vector<uint32_t> src_ids(dst_ids.size());
            for (size_t i = 0; i < src_ids.size(); ++i) {
                // Runs of up to seven pages adjacent on both sides: those coalesce into one
                // iovec.
                if (i % 8 != 0 && dst_ids[i - 1] + 1 < pages) {
                    dst_ids[i] = dst_ids[i - 1] + 1;
                    src_ids[i] = src_ids[i - 1] + 1;
                } else {
                    src_ids[i] = static_cast<uint32_t>(rng() % (pages - 8));
                }
            }
            // Destination pages taken twice would make the expected bytes ambiguous.
            std::vector<uint8_t> taken(pages, 0);
            std::vector<uint32_t> s_ids, d_ids;
            for (size_t i = 0; i < dst_ids.size(); ++i) {
                if (taken[dst_ids[i]]++) continue;
                s_ids.push_back(src_ids[i]);
                d_ids.push_back(dst_ids[i]);
            }
            if (ex.rank() == 0) {
                fill_pattern(s.region(), seed);
                PagedWriteOp op;
                op.peer = s.peer;
                op.src = s.mr.get();
                op.dst = &s.theirs;
                op.page_size = kPage;
                op.src_pages = s_ids;
                op.dst_pages = d_ids;
                op.imm = kImm;
                OpHandle h = s.engine->paged_write(op);
                CHILD_CHECK_OK(h.wait(kWait));
                CHILD_CHECK_MSG(h.imm_writes() == 1, "{} immediates for one paged write",
                                h.imm_writes());
                const EngineStats st = s.engine->stats();
                CHILD_CHECK_MSG(st.cma_bytes == d_ids.size() * kPage,
                                "{} bytes copied by CMA of {}", st.cma_bytes, d_ids.size() * kPage);
                CHILD_CHECK_MSG(st.bytes_posted == 0, "{} bytes went through the provider",
                                st.bytes_posted);
                CHILD_CHECK_OK(send_count(ex, h.imm_writes()));
            } else {
                CHILD_ASSIGN_OK(uint32_t expect, receive_count(ex));
                CHILD_CHECK_OK(s.engine->wait_imm(kImm, expect, kWait));
                std::vector<uint8_t> src(kRegion), want(kRegion, kPoison);
                fill_pattern(src, seed);
                for (size_t i = 0; i < d_ids.size(); ++i) {
                    std::memcpy(want.data() + d_ids[i] * kPage, src.data() + s_ids[i] * kPage,
                                kPage);
                }
                std::string diff = compare_bytes(s.region(), want);
                CHILD_CHECK_MSG(diff.empty(), "{}", diff);
                std::string guards = guards_intact(s);
                CHILD_CHECK_MSG(guards.empty(), "{}", guards);
            }
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

// A write or a run reaching past the region the peer's descriptor names is refused before
// any byte moves, naming the bytes and the region; the peer's memory around it stays as it
// was, and the engine keeps copying writes that fit.
TEST(CmaWrites, AWritePastTheRegionIsRefusedAndMovesNothing) {
    const uint64_t kLast = 8192;  // above shm's inject_size: a write CMA copies
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(Side s, make_side(ex, cma_config()));
            if (ex.rank() == 0) {
                std::memset(s.region().data(), 0x11, kRegion);
                Status past = s.engine
                                  ->write({s.peer, s.mr.get(), 0, &s.theirs, kRegion - kLast + 1,
                                           kLast, kImm})
                                  .wait(kWait);
                CHILD_CHECK_MSG(
                    past.code() == StatusCode::kOutOfRange &&
                        past.message().find("overrun the remote region") != std::string::npos,
                    "{}", past.to_string());
                std::vector<WriteRun> runs = {{0, 0, 64}, {0, kRegion - kLast, kLast + 1}};
                Status run =
                    s.engine->write_runs({s.peer, s.mr.get(), &s.theirs, runs, kImm}).wait(kWait);
                CHILD_CHECK_MSG(run.code() == StatusCode::kOutOfRange &&
                                    run.message().find("run 1") != std::string::npos,
                                "{}", run.to_string());
                CHILD_CHECK(s.engine->stats().cma_bytes == 0);
                // The region's last bytes are still the peer's to write.
                CHILD_CHECK_OK(
                    s.engine
                        ->write({s.peer, s.mr.get(), 0, &s.theirs, kRegion - kLast, kLast, kImm})
                        .wait(kWait));
                CHILD_CHECK(s.engine->stats().cma_bytes == kLast);
                CHILD_CHECK_OK(send_count(ex, 1));
            } else {
                CHILD_ASSIGN_OK(uint32_t expect, receive_count(ex));
                CHILD_CHECK_OK(s.engine->wait_imm(kImm, expect, kWait));
                std::string rest = check_fill(s.region(), 0, kRegion - kLast, kPoison);
                CHILD_CHECK_MSG(rest.empty(), "{}", rest);
                std::string last = check_fill(s.region(), kRegion - kLast, kLast, 0x11);
                CHILD_CHECK_MSG(last.empty(), "{}", last);
                std::string guards = guards_intact(s);
                CHILD_CHECK_MSG(guards.empty(), "{}", guards);
            }
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

// After the initiator's refused writes: it copied nothing, and (after a barrier) the target's
// whole buffer, region and guards, still holds the poison. "" when so.
std::string nothing_landed(Exchange& ex, const Side& s) {
    const uint64_t copied = ex.rank() == 0 ? s.engine->stats().cma_bytes : 0;
    Status met = ex.allgather({}).status();
    if (!met.ok()) return met.to_string();
    if (copied != 0) return fmt::format("{} bytes copied by CMA", copied);
    return ex.rank() == 1 ? check_fill(s.buf, 0, s.buf.size(), kPoison) : "";
}

// A region its owner deregistered takes no more writes: a write or a run under the old
// descriptor is refused before any byte moves, naming the deregistration, and the memory (still
// the owner's, no longer registered) keeps what it held, as shm's key check would keep it.
TEST(CmaWrites, ADeregisteredRegionTakesNoMoreWrites) {
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(Side s, make_side(ex, cma_config()));
            if (ex.rank() == 1) s.mr.reset();  // deregistered; the bytes stay allocated
            CHILD_CHECK_OK(ex.allgather({}).status());
            if (ex.rank() == 0) {
                std::memset(s.region().data(), 0x11, kRegion);
                Status one = s.engine->write({s.peer, s.mr.get(), 0, &s.theirs, 0, 64 << 10, kImm})
                                 .wait(kWait);
                CHILD_CHECK_MSG(one.code() == StatusCode::kNotFound &&
                                    one.message().find("deregistered") != std::string::npos,
                                "{}", one.to_string());
                std::vector<WriteRun> runs = {{0, 0, 8192}, {8192, 1 << 20, 8192}};
                Status many =
                    s.engine->write_runs({s.peer, s.mr.get(), &s.theirs, runs, kImm}).wait(kWait);
                CHILD_CHECK_MSG(many.code() == StatusCode::kNotFound, "{}", many.to_string());
            }
            std::string landed = nothing_landed(ex, s);
            CHILD_CHECK_MSG(landed.empty(), "{}", landed);
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

// Deregistration waits out the copies already inside the region: the initiator writes the
// whole region again and again while the owner deregisters it at a random moment and at once
// fills it with a new pattern, its end first; no write may land after that (each one either
// ended before the deregistration returned or is refused), so the new pattern stays whole.
TEST(CmaWrites, DeregistrationWaitsOutWritesInFlight) {
    constexpr size_t kTail = 64 << 10;
    const uint64_t seed = testing::test_seed("CmaFenceRace");
    for (int round = 0; round < 3; ++round) {
        auto results = run_processes(
            2,
            [&](Exchange& ex) -> std::string {
                CHILD_ASSIGN_OK(Side s, make_side(ex, cma_config()));
                if (ex.rank() == 0) {
                    fill_pattern(s.region(), seed + round);
                    const TimePoint until = deadline_after(std::chrono::seconds(20));
                    uint64_t landed = 0;
                    Status last;
                    while (Clock::now() < until) {
                        last = s.engine
                                   ->write(
                                       {s.peer, s.mr.get(), 0, &s.theirs, 0, kRegion, std::nullopt})
                                   .wait(kWait);
                        if (!last.ok()) break;
                        ++landed;
                    }
                    CHILD_CHECK_MSG(last.code() == StatusCode::kNotFound, "after {} writes: {}",
                                    landed, last.to_string());
                    CHILD_CHECK_MSG(landed > 0, "no write landed before the deregistration");
                } else {
                    std::mt19937_64 rng(seed + round);
                    std::this_thread::sleep_for(std::chrono::milliseconds(20 + rng() % 80));
                    s.mr.reset();
                    // The region's end first: a copy still running (they go front to back)
                    // reaches it after this and shows.
                    std::memset(s.region().data() + kRegion - kTail, 0x5A, kTail);
                    std::memset(s.region().data(), 0x5A, kRegion - kTail);
                }
                CHILD_CHECK_OK(ex.allgather({}).status());
                if (ex.rank() == 1) {
                    std::string after = check_fill(s.region(), 0, kRegion, 0x5A);
                    CHILD_CHECK_MSG(after.empty(), "a write landed after deregistration: {}",
                                    after);
                }
                return "";
            },
            kRunTimeout);
        ASSERT_EQ(testing::describe_failures(results), "") << "round " << round;
    }
}

// A descriptor whose bounds were altered (a larger length, an earlier base) passes the
// initiator's own check against it, but the owner's fence holds the bounds it registered: the
// write is refused, naming them, and nothing around the region is touched.
TEST(CmaWrites, AnAlteredDescriptorWritesNothingOutsideTheRegion) {
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(Side s, make_side(ex, cma_config()));
            if (ex.rank() == 0) {
                std::memset(s.region().data(), 0x11, kRegion);
                MemoryDescriptor longer = s.theirs;
                longer.length += kGuard;
                Status past =
                    s.engine->write({s.peer, s.mr.get(), 0, &longer, kRegion - 4096, 16384, kImm})
                        .wait(kWait);
                CHILD_CHECK_MSG(past.code() == StatusCode::kOutOfRange &&
                                    past.message().find("outside the region") != std::string::npos,
                                "{}", past.to_string());
                MemoryDescriptor earlier = s.theirs;
                earlier.base -= 8192;
                Status before =
                    s.engine->write({s.peer, s.mr.get(), 0, &earlier, 0, 16384, kImm}).wait(kWait);
                CHILD_CHECK_MSG(before.code() == StatusCode::kOutOfRange, "{}", before.to_string());
            }
            std::string landed = nothing_landed(ex, s);
            CHILD_CHECK_MSG(landed.empty(), "{}", landed);
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

// Lowers this process's effective capabilities by CAP_SYS_PTRACE, so that the kernel judges
// its process_vm_writev like an ordinary user's (as root, the capability overrides the
// target's refusal).
bool drop_ptrace_capability() {
    __user_cap_header_struct h{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct d[2] = {};
    if (::syscall(SYS_capget, &h, d) != 0) return false;
    d[CAP_SYS_PTRACE / 32].effective &= ~(1u << (CAP_SYS_PTRACE % 32));
    return ::syscall(SYS_capset, &h, d) == 0;
}

std::mutex cma_lines_mu;
std::vector<std::string> cma_lines;  // log lines naming process_vm_writev
void keep_cma_lines(LogLevel, std::string_view, std::string_view m, double) {
    std::lock_guard lk(cma_lines_mu);
    if (m.find("process_vm_writev") != std::string_view::npos) cma_lines.emplace_back(m);
}

// A target that is not dumpable refuses process_vm_writev (EPERM), as Yama's ptrace scope or
// another user's process would: the initiator says so once, in one log line, and sends that
// peer's writes through shm, whose bytes still arrive intact.
TEST(CmaWrites, APeerThatRefusesCmaGetsShmDecidedOnceAndLogged) {
    const uint64_t seed = testing::test_seed("CmaRefused");
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            if (ex.rank() == 0) {
                CHILD_CHECK(drop_ptrace_capability());
                set_log_sink(keep_cma_lines);
            } else {
                CHILD_CHECK(::prctl(PR_SET_DUMPABLE, 0) == 0);
            }
            CHILD_ASSIGN_OK(Side s, make_side(ex, cma_config()));
            const uint64_t kLen = 64 << 10;
            if (ex.rank() == 0) {
                fill_pattern(s.region(), seed);
                for (uint64_t i = 0; i < 3; ++i) {
                    CHILD_CHECK_OK(
                        s.engine
                            ->write({s.peer, s.mr.get(), i * kLen, &s.theirs, i * kLen, kLen, kImm})
                            .wait(kWait));
                }
                const EngineStats st = s.engine->stats();
                set_log_sink(nullptr);
                CHILD_CHECK_MSG(st.cma_bytes == 0, "{} bytes copied by CMA", st.cma_bytes);
                CHILD_CHECK_MSG(st.bytes_posted == 3 * kLen, "{} bytes through shm",
                                st.bytes_posted);
                std::lock_guard lk(cma_lines_mu);
                const std::vector<std::string>& lines = cma_lines;
                CHILD_CHECK_MSG(lines.size() == 1, "{} log lines about process_vm_writev",
                                lines.size());
                CHILD_CHECK_MSG(lines[0].find("not permitted") != std::string::npos &&
                                    lines[0].find("writes go through shm") != std::string::npos,
                                "{}", lines[0]);
                CHILD_CHECK_OK(send_count(ex, 3));
            } else {
                CHILD_ASSIGN_OK(uint32_t expect, receive_count(ex));
                CHILD_CHECK_OK(s.engine->wait_imm(kImm, expect, kWait));
                std::vector<uint8_t> src(kRegion), want(kRegion, kPoison);
                fill_pattern(src, seed);
                std::memcpy(want.data(), src.data(), 3 * kLen);
                std::string diff = compare_bytes(s.region(), want);
                CHILD_CHECK_MSG(diff.empty(), "{}", diff);
            }
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

// Regions offer CMA writes only where the engine may take them: cma_writes on, shm, libfabric's
// CMA not disabled (FI_SHM_DISABLE_CMA=1), registered for peer writes. The offer survives the
// descriptor's wire form.
TEST(CmaWrites, RegionsOfferItOnlyWhereAllowed) {
    std::vector<uint8_t> buf(4096);
    auto offered = [&](EngineConfig c, RemoteAccess access) -> Result<MemoryDescriptor> {
        FERRY_ASSIGN_OR_RETURN(auto e, TransferEngine::create(c));
        FERRY_ASSIGN_OR_RETURN(
            auto mr, e->register_memory(buf.data(), buf.size(), MemoryKind::kHost, -1, access));
        return mr->descriptor();
    };
    auto on = offered(cma_config(), RemoteAccess::kReadWrite);
    ASSERT_TRUE(on.ok()) << on.status().to_string();
    EXPECT_EQ(on->cma_pid, static_cast<int32_t>(::getpid()));
    EXPECT_NE(on->cma_start, 0u);
    auto back = MemoryDescriptor::deserialize(on->serialize());
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(back->cma_pid, on->cma_pid);
    EXPECT_EQ(back->cma_pid_ns, on->cma_pid_ns);
    EXPECT_EQ(back->cma_start, on->cma_start);
    EXPECT_EQ(back->cma_fence_fd, on->cma_fence_fd);
    EXPECT_EQ(back->cma_fence_slot, on->cma_fence_slot);
    EXPECT_EQ(back->cma_fence_gen, on->cma_fence_gen);
    EXPECT_GE(on->cma_fence_fd, 0);
    EXPECT_NE(on->cma_fence_slot, 0u);
    EXPECT_EQ(on->cma_fence_gen & 1, 1u);
    // An offer without its fence is not a descriptor any build makes: refused, named.
    MemoryDescriptor unfenced = *on;
    unfenced.cma_fence_gen = 2;
    auto refused = MemoryDescriptor::deserialize(unfenced.serialize());
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("without a fence"), std::string::npos)
        << refused.status().to_string();

    auto read_only = offered(cma_config(), RemoteAccess::kRead);
    ASSERT_TRUE(read_only.ok()) << read_only.status().to_string();
    EXPECT_EQ(read_only->cma_pid, 0);

    EngineConfig off = cma_config();
    off.cma_writes = false;
    auto not_asked = offered(off, RemoteAccess::kReadWrite);
    ASSERT_TRUE(not_asked.ok()) << not_asked.status().to_string();
    EXPECT_EQ(not_asked->cma_pid, 0);

    EngineConfig tcp = testing::test_engine_config("tcp");
    tcp.cma_writes = true;
    auto over_tcp = offered(tcp, RemoteAccess::kReadWrite);
    ASSERT_TRUE(over_tcp.ok()) << over_tcp.status().to_string();
    EXPECT_EQ(over_tcp->cma_pid, 0);

    ::setenv("FI_SHM_DISABLE_CMA", "1", 1);
    auto disabled = offered(cma_config(), RemoteAccess::kReadWrite);
    ::unsetenv("FI_SHM_DISABLE_CMA");
    ASSERT_TRUE(disabled.ok()) << disabled.status().to_string();
    EXPECT_EQ(disabled->cma_pid, 0);
}

}  // namespace
}  // namespace ferry
