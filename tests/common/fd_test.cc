#include "common/fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <utility>

namespace ferry {
namespace {

bool is_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

// A pipe's read end, owned by an Fd; the write end closed at once.
Fd pipe_end() {
    int p[2];
    EXPECT_EQ(::pipe(p), 0);
    ::close(p[1]);
    return Fd(p[0]);
}

TEST(Fd, ClosesItsDescriptorOnceWhenDestroyed) {
    int raw = -1;
    {
        Fd fd = pipe_end();
        raw = fd.get();
        EXPECT_TRUE(fd.valid());
        EXPECT_TRUE(is_open(raw));
    }
    EXPECT_FALSE(is_open(raw));
}

TEST(Fd, MoveHandsTheDescriptorOverAndAssignmentClosesTheOldOne) {
    Fd a = pipe_end();
    const int raw = a.get();
    Fd b(std::move(a));
    EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): moved-from is empty
    EXPECT_EQ(b.get(), raw);
    Fd c = pipe_end();
    const int old = c.get();
    c = std::move(b);
    EXPECT_EQ(c.get(), raw);
    EXPECT_FALSE(is_open(old));
    EXPECT_TRUE(is_open(raw));
}

TEST(Fd, MovingIntoItselfKeepsTheDescriptorOpen) {
    Fd fd = pipe_end();
    const int raw = fd.get();
    Fd& same = fd;
    fd = std::move(same);
    EXPECT_EQ(fd.get(), raw);
    EXPECT_TRUE(is_open(raw));
}

TEST(Fd, ReleaseGivesTheDescriptorUpUnclosed) {
    Fd fd = pipe_end();
    const int raw = fd.release();
    EXPECT_FALSE(fd.valid());
    EXPECT_TRUE(is_open(raw));
    ::close(raw);
}

}  // namespace
}  // namespace ferry
