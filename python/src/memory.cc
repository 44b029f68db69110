#include "memory.h"

#include <string>

#include "convert.h"
#include "errors.h"

namespace py = pybind11;

namespace ferry::python {

BufferHold BufferHold::acquire(py::handle obj, bool writable) {
    if (!PyObject_CheckBuffer(obj.ptr())) {
        throw StatusError(
            invalid_argument("cannot register a " + type_name(obj) +
                             ": not a buffer, tensor or (ptr, nbytes, device) tuple"));
    }
    BufferHold h;
    // Strides are asked for so that a non-contiguous array is seen and named, not refused by
    // the exporter with its own message.
    if (PyObject_GetBuffer(obj.ptr(), &h.view_, PyBUF_STRIDES) != 0) {
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
