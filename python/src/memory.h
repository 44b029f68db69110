// Host memory of Python objects through the buffer protocol (numpy arrays, bytearray,
// memoryview, mmap, array.array...): the buffer is held (Py_buffer) for as long as its region
// is registered, which keeps the object alive and stops a bytearray from being resized under
// the engine.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>

namespace ferry::python {

class BufferHold {
  public:
    BufferHold() = default;
    BufferHold(const BufferHold&) = delete;
    BufferHold& operator=(const BufferHold&) = delete;
    BufferHold(BufferHold&& o) noexcept : view_(o.view_), held_(o.held_) { o.held_ = false; }
    BufferHold& operator=(BufferHold&& o) noexcept {
        if (this != &o) {
            release();
            view_ = o.view_;
            held_ = o.held_;
            o.held_ = false;
        }
        return *this;
    }
    ~BufferHold() { release(); }  // called with the GIL held (object destruction)

    // Takes a C-contiguous buffer of `obj`; `writable` refuses read-only ones. Throws
    // StatusError (invalid argument) naming what is wrong with the object.
    static BufferHold acquire(pybind11::handle obj, bool writable);

    void* data() const { return view_.buf; }
    size_t size() const { return static_cast<size_t>(view_.len); }
    bool read_only() const { return view_.readonly != 0; }
    void release();

  private:
    Py_buffer view_{};
    bool held_ = false;
};

}  // namespace ferry::python
