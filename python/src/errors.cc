#include "errors.h"

#include <array>
#include <string>

namespace py = pybind11;

namespace ferry::python {
namespace {

struct ErrorClass {
    StatusCode code;
    const char* name;
    const char* doc;
    PyObject* builtin;  // a builtin base besides ferry.Error, so `except TimeoutError` works
};

// Python class objects, indexed by StatusCode; created once at import and kept for the
// interpreter's life (module attributes hold them too).
std::array<PyObject*, static_cast<size_t>(StatusCode::kAlreadyExists) + 1> g_classes{};
PyObject* g_base = nullptr;
PyObject* g_invalid_type = nullptr;  // InvalidArgument and TypeError

PyObject* class_for(StatusCode code) {
    auto i = static_cast<size_t>(code);
    if (i < g_classes.size() && g_classes[i] != nullptr) return g_classes[i];
    return g_base;
}

}  // namespace

void register_errors(py::module_& m) {
    // A RuntimeError, so that code catching the builtin catches ferry's too.
    g_base = PyErr_NewExceptionWithDoc(
        "ferry.Error",
        "Base of every error ferry raises (a RuntimeError); str(e) is ferry's message, e.code "
        "the status code's name (\"timeout\", \"out of range\", ...).",
        PyExc_RuntimeError, nullptr);
    if (g_base == nullptr) throw py::error_already_set();
    m.attr("Error") = py::handle(g_base);

    const ErrorClass classes[] = {
        {StatusCode::kInvalidArgument, "InvalidArgument",
         "The caller passed something malformed or out of range.", PyExc_ValueError},
        {StatusCode::kOutOfRange, "OutOfRange",
         "An access outside a registered region (rejected before anything is posted).",
         PyExc_IndexError},
        {StatusCode::kNotFound, "NotFound", "Unknown peer, region or descriptor.", nullptr},
        {StatusCode::kTimeout, "TimeoutError",
         "A deadline passed (an operation's op_timeout, or the timeout of a wait).",
         PyExc_TimeoutError},
        {StatusCode::kUnavailable, "Unavailable",
         "Peer dead or unreachable, provider or GPU missing.", nullptr},
        {StatusCode::kCancelled, "Cancelled",
         "Cancelled by a user or by shutdown (a closed engine).", nullptr},
        {StatusCode::kResourceExhausted, "ResourceExhausted", "Out of a bounded resource.",
         nullptr},
        {StatusCode::kProtocol, "ProtocolError",
         "A blob that does not parse: truncated, corrupted, or from an incompatible build.",
         nullptr},
        {StatusCode::kProvider, "ProviderError", "libfabric or CUDA reported an error.", nullptr},
        {StatusCode::kInternal, "InternalError",
         "A bug in ferry; please report it with the message.", nullptr},
        {StatusCode::kPermissionDenied, "PermissionDenied",
         "The peer did not prove the deployment secret (KV handshake).", PyExc_PermissionError},
        {StatusCode::kAlreadyExists, "AlreadyExists",
         "Something with that id is live already (a transfer id in use).", nullptr},
    };
    for (const auto& c : classes) {
        std::string qualified = std::string("ferry.") + c.name;
        py::object bases =
            c.builtin ? py::object(py::make_tuple(py::handle(g_base), py::handle(c.builtin)))
                      : py::object(py::reinterpret_borrow<py::object>(g_base));
        PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), c.doc, bases.ptr(), nullptr);
        if (cls == nullptr) throw py::error_already_set();
        g_classes[static_cast<size_t>(c.code)] = cls;
        // As a class attribute too: errors the Python layer raises itself (InvalidArgument
        // naming an argument) carry e.code like those from C++.
        py::handle(cls).attr("code") = py::str(std::string(status_code_name(c.code)));
        m.attr(c.name) = py::handle(cls);
    }
    py::object invalid_type_bases = py::make_tuple(
        py::handle(class_for(StatusCode::kInvalidArgument)), py::handle(PyExc_TypeError));
    g_invalid_type = PyErr_NewExceptionWithDoc(
        "ferry.InvalidType",
        "An argument of the wrong type (None, a string where an int goes, a numpy array where a "
        "tensor goes): an InvalidArgument that is also a TypeError.",
        invalid_type_bases.ptr(), nullptr);
    if (g_invalid_type == nullptr) throw py::error_already_set();
    m.attr("InvalidType") = py::handle(g_invalid_type);

    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const StatusError& e) {
            set_python_error(e.status(), e.is_wrong_type());
        }
    });
}

void set_python_error(const Status& status, bool wrong_type) {
    PyObject* cls =
        wrong_type && g_invalid_type != nullptr ? g_invalid_type : class_for(status.code());
    py::object exc = py::reinterpret_steal<py::object>(
        PyObject_CallFunction(cls, "s", status.message().c_str()));
    if (!exc) return;  // the call set its own Python error
    // e.code: the status code's name ("timeout"), for callers that switch on it.
    std::string code(status_code_name(status.code()));
    PyObject_SetAttrString(exc.ptr(), "code", py::str(code).ptr());
    PyErr_SetObject(cls, exc.ptr());
}

}  // namespace ferry::python
