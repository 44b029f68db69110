#include "ferry/common/auth.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "ferry/fabric/types.h"  // to_hex

namespace ferry {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir(const std::string& name) {
    fs::path d = fs::temp_directory_path() / fmt::format("ferry-auth-{}-{}", ::getpid(), name);
    fs::remove_all(d);
    fs::create_directories(d);
    return d;
}

std::vector<uint8_t> bytes_of(const Secret& s) { return {s.bytes().begin(), s.bytes().end()}; }

// RFC 4231 test case 6 (its other cases use keys shorter than a Secret may be).
TEST(Auth, HmacMatchesRfc4231TestCase6) {
    auto s = Secret::from_bytes(std::vector<uint8_t>(131, 0xaa)).value();
    std::string msg = "Test Using Larger Than Block-Size Key - Hash Key First";
    Digest d = hmac_sha256(s, {reinterpret_cast<const uint8_t*>(msg.data()), msg.size()});
    EXPECT_EQ(to_hex(d), "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

// FIPS 180-2's "abc".
TEST(Auth, Sha256MatchesTheStandardVector) {
    std::string msg = "abc";
    EXPECT_EQ(to_hex(sha256({reinterpret_cast<const uint8_t*>(msg.data()), msg.size()})),
              "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Auth, ConstantTimeEqualAndHex) {
    std::vector<uint8_t> a{1, 2, 3}, b{1, 2, 3}, c{1, 2, 4}, d{1, 2};
    EXPECT_TRUE(constant_time_equal(a, b));
    EXPECT_FALSE(constant_time_equal(a, c));
    EXPECT_FALSE(constant_time_equal(a, d));
    EXPECT_EQ(to_hex(a), "010203");
    EXPECT_EQ(from_hex("0A0b0c", 3, "x").value(), (std::vector<uint8_t>{10, 11, 12}));
    EXPECT_FALSE(from_hex("0a0b", 3, "field_x").ok());
    EXPECT_NE(from_hex("zz", 1, "field_x").status().message().find("field_x"), std::string::npos);
    EXPECT_FALSE(Secret::from_bytes(std::vector<uint8_t>(15, 1)).ok());
}

TEST(SecretFile, GeneratedOnFirstUseWithMode0600AndReadBackTheSame) {
    fs::path d = temp_dir("gen");
    std::string path = (d / "sub" / "deployment.secret").string();
    auto a = load_or_create_secret_file(path);
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_EQ(st.st_size, off_t(Secret::kGeneratedBytes));
    ASSERT_EQ(::stat((d / "sub").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 077, 0u);
    auto b = load_or_create_secret_file(path);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(bytes_of(*a), bytes_of(*b));
    // No temporary file is left behind.
    EXPECT_EQ(std::distance(fs::directory_iterator(d / "sub"), fs::directory_iterator{}), 1);
    fs::remove_all(d);
}

TEST(SecretFile, ConcurrentFirstStartsAgree) {
    for (int round = 0; round < 5; ++round) {
        fs::path d = temp_dir("race" + std::to_string(round));
        std::string path = (d / "deployment.secret").string();
        constexpr int kThreads = 8;
        std::vector<std::vector<uint8_t>> got(kThreads);
        std::vector<std::string> errors(kThreads);
        std::vector<std::thread> ts;
        for (int i = 0; i < kThreads; ++i)
            ts.emplace_back([&, i] {
                auto s = load_or_create_secret_file(path);
                if (s.ok())
                    got[i] = bytes_of(*s);
                else
                    errors[i] = s.status().to_string();
            });
        for (auto& t : ts) t.join();
        for (int i = 0; i < kThreads; ++i) {
            EXPECT_EQ(errors[i], "") << "thread " << i;
            EXPECT_EQ(got[i], got[0]) << "round " << round << " thread " << i;
        }
        EXPECT_EQ(std::distance(fs::directory_iterator(d), fs::directory_iterator{}), 1);
        fs::remove_all(d);
    }
}

TEST(SecretFile, BadFilesGiveErrorsNamingTheFile) {
    fs::path d = temp_dir("bad");
    auto write = [&](const std::string& name, const std::string& content, mode_t mode) {
        std::string p = (d / name).string();
        std::ofstream(p) << content;
        ::chmod(p.c_str(), mode);
        return p;
    };
    struct Case {
        std::string path, words;
    };
    std::vector<Case> cases = {
        {write("empty", "", 0600), "is empty"},
        {write("short", "0123456789", 0600), "holds 10 bytes"},
        {write("open", std::string(32, 'k'), 0644), "chmod 600"},
        {(d / "missing").string(), "cannot open"},
    };
    if (::geteuid() != 0)
        cases.push_back({write("unreadable", std::string(32, 'k'), 0000), "cannot open"});
    for (const Case& c : cases) {
        auto s = load_secret_file(c.path);
        ASSERT_FALSE(s.ok()) << c.path;
        EXPECT_NE(s.status().message().find(c.path), std::string::npos) << s.status().message();
        EXPECT_NE(s.status().message().find(c.words), std::string::npos) << s.status().message();
    }
    // An existing bad file is not replaced by load_or_create either.
    auto s = load_or_create_secret_file((d / "open").string());
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.status().message().find("group or others"), std::string::npos);
    EXPECT_TRUE(load_secret_file(write("good", std::string(32, 'k'), 0600)).ok());
    fs::remove_all(d);
}

}  // namespace
}  // namespace ferry
