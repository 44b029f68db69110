// Control messages as rail 0's worker hands them over: malformed wire bytes, handlers that
// replace themselves or throw, messages held while no handler is set.
#include "fabric/control.h"

#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <vector>

namespace ferry::detail {
namespace {

std::vector<uint8_t> wire(uint64_t sender, const std::string& text,
                          uint32_t magic = 0x46524d53 /* "FRMS" */) {
    std::vector<uint8_t> w(12 + text.size());
    std::memcpy(w.data(), &magic, 4);
    std::memcpy(w.data() + 4, &sender, 8);
    std::memcpy(w.data() + 12, text.data(), text.size());
    return w;
}

std::string text_of(std::span<const uint8_t> p) { return std::string(p.begin(), p.end()); }

// Runs deliver() on a thread of its own, as rail 0's worker does; false if it did not return
// within the budget (the channel and the thread are then left behind, stuck).
bool deliver_within(ControlChannel& ch, std::vector<uint8_t> w,
                    std::chrono::milliseconds budget = std::chrono::seconds(2)) {
    auto done = std::make_shared<std::promise<void>>();
    auto fut = done->get_future();
    std::thread([&ch, w = std::move(w), done] {
        ch.deliver(w);
        done->set_value();
    }).detach();
    return fut.wait_for(budget) == std::future_status::ready;
}

TEST(ControlChannel, MalformedMessagesAreDroppedAndCountedTheNextIsDelivered) {
    EngineConfig config;
    ControlChannel ch(config);
    std::vector<std::pair<uint64_t, std::string>> got;
    ch.set_handler(
        [&](uint64_t s, std::span<const uint8_t> p) { got.emplace_back(s, text_of(p)); });
    ch.deliver({});
    ch.deliver(std::vector<uint8_t>(11, 0x46));              // one byte short of a header
    ch.deliver(wire(7, "not ours", 0x50545448 /* HTTP */));  // another protocol's bytes
    EXPECT_EQ(ch.dropped(), 3u);
    EXPECT_TRUE(got.empty());
    ch.deliver(wire(7, ""));  // a header alone is an empty message
    ch.deliver(wire(0xabc, "hello"));
    ASSERT_EQ(got.size(), 2u);
    EXPECT_EQ(got[0], std::make_pair(uint64_t{7}, std::string()));
    EXPECT_EQ(got[1], std::make_pair(uint64_t{0xabc}, std::string("hello")));
    EXPECT_EQ(ch.dropped(), 3u);
}

TEST(ControlChannel, MessagesHeldWithoutAHandlerAreBoundedAndDeliveredInOrder) {
    EngineConfig config;
    config.message_recv_buffers = 2;  // holds 32
    ControlChannel ch(config);
    for (int i = 0; i < 40; ++i) ch.deliver(wire(1, std::to_string(i)));
    EXPECT_EQ(ch.dropped(), 8u);
    std::vector<std::string> got;
    ch.set_handler([&](uint64_t, std::span<const uint8_t> p) { got.push_back(text_of(p)); });
    ASSERT_EQ(got.size(), 32u);
    for (int i = 0; i < 32; ++i) EXPECT_EQ(got[i], std::to_string(i));
}

TEST(ControlChannel, AHandlerMayReplaceItself) {
    EngineConfig config;
    // Left behind if delivery deadlocks: the stuck thread still uses it.
    auto* ch = new ControlChannel(config);
    std::vector<std::string> first, second;
    ch->set_handler([&](uint64_t, std::span<const uint8_t> p) {
        first.push_back(text_of(p));
        // A one-shot handler: the rest go to the next one. Its own captures must stay valid
        // until it returns, though it is replaced.
        ch->set_handler(
            [&](uint64_t, std::span<const uint8_t> q) { second.push_back(text_of(q)); });
        first.push_back("still running");
    });
    ASSERT_TRUE(deliver_within(*ch, wire(1, "a"))) << "set_handler inside a handler deadlocked";
    ASSERT_TRUE(deliver_within(*ch, wire(1, "b")));
    EXPECT_EQ(first, (std::vector<std::string>{"a", "still running"}));
    EXPECT_EQ(second, (std::vector<std::string>{"b"}));

    // Held messages flushed to a handler that clears itself: the rest are held again.
    ch->set_handler({});
    for (const char* m : {"c", "d"}) ASSERT_TRUE(deliver_within(*ch, wire(1, m)));
    std::vector<std::string> third;
    ch->set_handler([&](uint64_t, std::span<const uint8_t> p) {
        third.push_back(text_of(p));
        ch->set_handler({});
    });
    EXPECT_EQ(third, (std::vector<std::string>{"c"}));
    ch->set_handler([&](uint64_t, std::span<const uint8_t> p) { third.push_back(text_of(p)); });
    EXPECT_EQ(third, (std::vector<std::string>{"c", "d"}));
    delete ch;
}

TEST(ControlChannel, AHandlerThatThrowsLosesItsMessageNotTheProcess) {
    EngineConfig config;
    ControlChannel ch(config);
    std::vector<std::string> got;
    ch.set_handler([&](uint64_t, std::span<const uint8_t> p) {
        std::string t = text_of(p);
        if (t == "bad") throw std::runtime_error("cannot parse");
        if (t == "worse") throw 42;
        got.push_back(t);
    });
    EXPECT_NO_THROW(ch.deliver(wire(1, "bad")));
    EXPECT_NO_THROW(ch.deliver(wire(1, "worse")));
    ch.deliver(wire(1, "good"));
    EXPECT_EQ(got, (std::vector<std::string>{"good"}));
    EXPECT_EQ(ch.dropped(), 2u);
}

TEST(ControlChannel, SetHandlerFromAnotherThreadWaitsForTheRunningCall) {
    EngineConfig config;
    ControlChannel ch(config);
    std::promise<void> entered, release;
    auto released = release.get_future().share();
    std::atomic<bool> old_running{false};
    ch.set_handler([&](uint64_t, std::span<const uint8_t>) {
        old_running = true;
        entered.set_value();
        released.wait();
        old_running = false;
    });
    std::thread worker([&] { ch.deliver(wire(1, "x")); });
    entered.get_future().wait();
    std::atomic<bool> replaced{false};
    std::thread other([&] {
        ch.set_handler([](uint64_t, std::span<const uint8_t>) {});
        replaced = true;
        EXPECT_FALSE(old_running.load()) << "set_handler returned while the old one ran";
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_FALSE(replaced.load());
    release.set_value();
    worker.join();
    other.join();
    EXPECT_TRUE(replaced.load());
}

}  // namespace
}  // namespace ferry::detail
