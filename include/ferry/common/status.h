// One error type for all of ferry: every fallible call returns Status or Result<T>.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace ferry {

enum class StatusCode {
    kOk = 0,
    kInvalidArgument,  // the caller passed something malformed or out of range
    kOutOfRange,       // an access outside a registered region
    kNotFound,         // unknown peer, transfer id, descriptor
    kTimeout,          // a deadline passed
    kUnavailable,      // peer dead or unreachable, provider missing
    kCancelled,        // the operation was cancelled by a user or by shutdown
    kResourceExhausted,
    kProtocol,  // a message that does not parse or does not fit the protocol
    kProvider,  // libfabric or CUDA reported an error
    kInternal,
    // the caller did not prove it may do this (a missing or wrong authentication tag); after
    // kInternal so that codes already on the wire (FAIL messages) keep their values
    kPermissionDenied,
    // something with that id is already live (a transfer id another transfer holds)
    kAlreadyExists,
};

std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
  public:
    Status() = default;
    Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

    static Status ok_status() { return Status(); }

    bool ok() const { return code_ == StatusCode::kOk; }
    StatusCode code() const { return code_; }
    const std::string& message() const { return message_; }

    // "timeout: waiting for 4 writes with immediate 0x12: 2 arrived".
    std::string to_string() const;

    // Returns a copy with "context: " put in front of the message.
    Status with_context(std::string_view context) const;

  private:
    StatusCode code_ = StatusCode::kOk;
    std::string message_;
};

inline Status ok_status() { return Status(); }
Status invalid_argument(std::string message);
Status out_of_range(std::string message);
Status not_found(std::string message);
Status timeout_error(std::string message);
Status unavailable(std::string message);
Status cancelled(std::string message);
Status resource_exhausted(std::string message);
Status protocol_error(std::string message);
Status provider_error(std::string message);
Status internal_error(std::string message);
Status permission_denied(std::string message);
Status already_exists(std::string message);

template <typename T>
class [[nodiscard]] Result {
  public:
    Result(T value) : value_(std::move(value)) {}         // NOLINT(google-explicit-constructor)
    Result(Status status) : status_(std::move(status)) {  // NOLINT(google-explicit-constructor)
        assert(!status_.ok() && "a Result holding no value needs an error status");
        if (status_.ok()) status_ = internal_error("Result built from an ok Status");
    }

    bool ok() const { return value_.has_value(); }
    const Status& status() const { return status_; }

    T& value() & { return *value_; }
    const T& value() const& { return *value_; }
    T&& value() && { return std::move(*value_); }
    T* operator->() { return &*value_; }
    const T* operator->() const { return &*value_; }
    T& operator*() & { return *value_; }
    const T& operator*() const& { return *value_; }

  private:
    std::optional<T> value_;
    Status status_;
};

}  // namespace ferry

#define FERRY_CONCAT_INNER(a, b) a##b
#define FERRY_CONCAT(a, b) FERRY_CONCAT_INNER(a, b)

// Returns the status from the enclosing function if it is an error.
#define FERRY_RETURN_IF_ERROR(expr)                    \
    do {                                               \
        ::ferry::Status ferry_status_ = (expr);        \
        if (!ferry_status_.ok()) return ferry_status_; \
    } while (0)

// FERRY_ASSIGN_OR_RETURN(auto x, make_x()); returns the error if make_x() failed.
#define FERRY_ASSIGN_OR_RETURN(lhs, expr) \
    FERRY_ASSIGN_OR_RETURN_IMPL(FERRY_CONCAT(ferry_result_, __LINE__), lhs, expr)
#define FERRY_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
    auto tmp = (expr);                              \
    if (!tmp.ok()) return tmp.status();             \
    lhs = std::move(tmp).value()
