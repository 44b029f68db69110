#include "memory.h"

#include <cstring>
#include <string>

#include "convert.h"
#include "errors.h"

namespace py = pybind11;

namespace ferry::python {
namespace {

// Whether a struct-module format string (PEP 3118) has an 'O' (a PyObject*) item: numpy's
// dtype=object arrays and structured dtypes with an object field. Field names (":name:")
// are skipped.
bool holds_python_objects(const char* format) {
    if (format == nullptr) return false;  // unsigned bytes
    for (const char* p = format; *p != '\0'; ++p) {
        if (*p == ':') {
            const char* end = std::strchr(p + 1, ':');
            if (end == nullptr) return false;
            p = end;
        } else if (*p == 'O') {
            return true;
        }
    }
    return false;
}

}  // namespace

BufferHold BufferHold::acquire(py::handle obj, bool writable) {
    if (!PyObject_CheckBuffer(obj.ptr())) {
        throw StatusError::wrong_type("cannot register a " + type_name(obj) +
                                      ": not a buffer, tensor or (ptr, nbytes, device) tuple");
    }
    BufferHold h;
    // Strides are asked for so that a non-contiguous array is seen and named, not refused by
    // the exporter with its own message; the format, to see Python objects.
    if (PyObject_GetBuffer(obj.ptr(), &h.view_, PyBUF_STRIDES | PyBUF_FORMAT) != 0) {
        std::string why = py::error_already_set().what();
        throw StatusError(
            invalid_argument("cannot get the buffer of a " + type_name(obj) + ": " + why));
    }
    h.held_ = true;
    if (!PyBuffer_IsContiguous(&h.view_, 'C')) {
        throw StatusError(invalid_argument("cannot register a non-contiguous " + type_name(obj) +
                                           ": ferry moves contiguous bytes; pass a contiguous copy "
                                           "(numpy.ascontiguousarray(a), t.contiguous())"));
    }
    if (holds_python_objects(h.view_.format)) {
        throw StatusError(invalid_argument(
            "cannot register a " + type_name(obj) + " of Python objects (format '" +
            std::string(h.view_.format) +
            "'): its bytes are object pointers, which a peer's write would turn into a crash; "
            "register numbers (a numeric dtype) instead"));
    }
    if (writable && h.view_.readonly) {
        throw StatusError(invalid_argument(
            "cannot register a read-only " + type_name(obj) +
            ": peers would write into it; pass a writable buffer (bytearray, a writable array) "
            "or register(obj, read_only=True) to use it only as a source"));
    }
    return h;
}

void BufferHold::release() {
    if (held_) PyBuffer_Release(&view_);
    held_ = false;
}

}  // namespace ferry::python
