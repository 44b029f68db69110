// ferry's Status as Python exceptions: ferry.Error and one subclass per status code. C++ code
// in the bindings throws StatusError; the translator registered by register_errors turns it
// into the matching Python class carrying ferry's message, so no Status is lost and no C++
// exception reaches the interpreter untranslated.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <string>
#include <utility>

#include "ferry/common/status.h"

namespace ferry::python {

class StatusError : public std::exception {
  public:
    explicit StatusError(Status status) : status_(std::move(status)) {}
    // An argument of the wrong type (None, a str where an int goes): raised as
    // ferry.InvalidType, an InvalidArgument that is also a TypeError.
    static StatusError wrong_type(const std::string& message) {
        StatusError e(invalid_argument(message));
        e.wrong_type_ = true;
        return e;
    }
    const Status& status() const { return status_; }
    bool is_wrong_type() const { return wrong_type_; }
    const char* what() const noexcept override { return status_.message().c_str(); }

  private:
    Status status_;
    bool wrong_type_ = false;
};

// Throws StatusError when `status` is an error.
inline void check(const Status& status) {
    if (!status.ok()) throw StatusError(status);
}

template <typename T>
T take(Result<T>&& result) {
    if (!result.ok()) throw StatusError(result.status());
    return std::move(result).value();
}

// For a type the user gets from a call and never constructs: calling it raises a TypeError
// saying where such objects come from, not pybind11's "No constructor defined".
template <typename Class>
void obtained_from(Class& cls, const std::string& name, const std::string& how) {
    std::string message = name + " objects cannot be created directly: " + how;
    cls.def("__init__",
            [message](pybind11::handle, const pybind11::args&, const pybind11::kwargs&) {
                throw pybind11::type_error(message);
            });
}

// Creates ferry.Error and its subclasses in module `m` and registers the translator.
void register_errors(pybind11::module_& m);

// Sets the Python error for `status` (its ferry.Error subclass, carrying the message; with
// wrong_type ferry.InvalidType), for code that returns to the interpreter without pybind11
// (the write fast path).
void set_python_error(const Status& status, bool wrong_type = false);

}  // namespace ferry::python
