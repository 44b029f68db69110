#include "ferry/common/status.h"

#include "common/enum_names.h"

namespace ferry {

namespace {

constexpr EnumName<StatusCode> kCodeNames[] = {
    {StatusCode::kOk, "ok"},
    {StatusCode::kInvalidArgument, "invalid argument"},
    {StatusCode::kOutOfRange, "out of range"},
    {StatusCode::kNotFound, "not found"},
    {StatusCode::kTimeout, "timeout"},
    {StatusCode::kUnavailable, "unavailable"},
    {StatusCode::kCancelled, "cancelled"},
    {StatusCode::kResourceExhausted, "resource exhausted"},
    {StatusCode::kProtocol, "protocol error"},
    {StatusCode::kProvider, "provider error"},
    {StatusCode::kInternal, "internal error"},
    {StatusCode::kPermissionDenied, "permission denied"},
    {StatusCode::kAlreadyExists, "already exists"},
};

}  // namespace

std::string_view status_code_name(StatusCode code) { return name_of(kCodeNames, code); }

std::string Status::to_string() const {
    if (ok()) return "ok";
    std::string s(status_code_name(code_));
    s += ": ";
    s += message_;
    return s;
}

Status Status::with_context(std::string_view context) const {
    if (ok()) return *this;
    std::string m(context);
    m += ": ";
    m += message_;
    return Status(code_, std::move(m));
}

Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
Status out_of_range(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
Status timeout_error(std::string m) { return {StatusCode::kTimeout, std::move(m)}; }
Status unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
Status cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
Status resource_exhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
Status protocol_error(std::string m) { return {StatusCode::kProtocol, std::move(m)}; }
Status provider_error(std::string m) { return {StatusCode::kProvider, std::move(m)}; }
Status internal_error(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
Status permission_denied(std::string m) { return {StatusCode::kPermissionDenied, std::move(m)}; }
Status already_exists(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }

}  // namespace ferry
