// pybind11 glue shared by the plugins' compiled modules (torch-free, ABI 1).
//
//   tensor_arg(name, obj)   a Python tuple (ptr, shape, strides, dtype_code) -> TensorArg
//   tensor_args({names}, {objs})  several at once, in order:
//                           const auto [x, out] = tensor_args({"x", "out"}, {x_arg, out_arg});
//   stream_arg(handle)      a Python int (torch's `cuda_stream`) -> cudaStream_t
//   init_module(m)          error translation (ValueError / RuntimeError with .cuda_error) + build_info()
//
// build_info() reports what CMake compiled in (the ASTRAI_BUILD_* macros of the
// generated astrai_build_config.h) and the toolkit's CUDART_VERSION.
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "astrai/check.h"
#include "astrai/dtype.h"
#include "astrai/tensor_arg.h"

// AstraiPlugin.cmake generates this header per module: ASTRAI_BUILD_SASS / _PTX
// (comma-separated "sm_90a" / "compute_90") and ASTRAI_BUILD_NVCC ("13.0.88").
#if __has_include("astrai_build_config.h")
#include "astrai_build_config.h"
#endif
#ifndef ASTRAI_BUILD_SASS
#define ASTRAI_BUILD_SASS ""
#define ASTRAI_BUILD_PTX ""
#define ASTRAI_BUILD_NVCC ""
#endif

namespace astrai::bind {

namespace py = pybind11;

inline std::vector<std::string> split_list(const std::string& text) {
    std::vector<std::string> out;
    size_t start = 0;
    while (start <= text.size()) {
        size_t end = text.find(',', start);
        if (end == std::string::npos) end = text.size();
        if (end > start) out.push_back(text.substr(start, end - start));
        start = end + 1;
    }
    return out;
}

// An int that fits int64 -> true and *out; anything else -> false (no Python error left set).
inline bool int64_of(PyObject* obj, int64_t* out) {
    if (!PyLong_Check(obj)) return false;
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
    }
    *out = static_cast<int64_t>(value);
    return true;
}

inline std::vector<int64_t> int_list(const char* name, const char* field, py::handle obj) {
    PyObject* seq = obj.ptr();
    if (PyTuple_Check(seq)) {  // what the wrappers pass: read in place (this runs on every launch)
        const Py_ssize_t n = PyTuple_GET_SIZE(seq);
        std::vector<int64_t> out(static_cast<size_t>(n));
        for (Py_ssize_t i = 0; i < n; ++i) {
            PyObject* item = PyTuple_GET_ITEM(seq, i);
            ASTRAI_CHECK(PyLong_Check(item), name, ": ", field, " must hold ints");
            ASTRAI_CHECK(int64_of(item, &out[static_cast<size_t>(i)]), name, ": ", field, " holds an int beyond int64");
        }
        return out;
    }
    ASTRAI_CHECK(py::isinstance<py::sequence>(obj) && !py::isinstance<py::str>(obj), name, ": ",
                 field, " must be a sequence of ints, got ", std::string(py::str(py::type::of(obj).attr("__name__"))));
    std::vector<int64_t> out;
    for (py::handle item : py::reinterpret_borrow<py::sequence>(obj)) {
        ASTRAI_CHECK(py::isinstance<py::int_>(item), name, ": ", field, " must hold ints");
        out.push_back(item.cast<int64_t>());
    }
    return out;
}

// (ptr, shape, strides, dtype_code) -> TensorArg, checked for consistent shape/strides. Read
// with the C API: this runs for every tensor of every launch.
inline TensorArg tensor_arg(const char* name, py::handle obj) {
    PyObject* tup = obj.ptr();
    ASTRAI_CHECK(PyTuple_Check(tup) && PyTuple_GET_SIZE(tup) == 4, name,
                 ": expected a tuple (data_ptr, shape, strides, dtype_code)");
    TensorArg t;
    t.name = name;
    PyObject* ptr = PyTuple_GET_ITEM(tup, 0);
    ASTRAI_CHECK(PyLong_Check(ptr), name, ": data_ptr must be an int");
    int64_t small = 0;
    if (int64_of(ptr, &small)) {
        ASTRAI_CHECK(small >= 0, name, ": data_ptr must be >= 0");
        t.ptr = static_cast<std::uintptr_t>(small);
    } else {  // beyond int64: must still be a pointer
        ASTRAI_CHECK(py::reinterpret_borrow<py::int_>(ptr) >= py::int_(0), name, ": data_ptr must be >= 0");
        t.ptr = py::reinterpret_borrow<py::int_>(ptr).cast<std::uintptr_t>();
    }
    t.shape = int_list(name, "shape", PyTuple_GET_ITEM(tup, 1));
    t.strides = int_list(name, "strides", PyTuple_GET_ITEM(tup, 2));
    PyObject* code = PyTuple_GET_ITEM(tup, 3);
    int64_t dtype = -1;
    ASTRAI_CHECK(PyLong_Check(code), name, ": dtype_code must be an int");
    ASTRAI_CHECK(int64_of(code, &dtype), name, ": unknown dtype code (beyond int64)");
    t.dtype = dtype_from_code(dtype, name);
    check_layout(t);
    return t;
}

// tensor_arg of each (name, obj) pair, checked in order (the first bad argument is the one reported).
template <std::size_t N>
std::array<TensorArg, N> tensor_args(const char* const (&names)[N], const py::handle (&objs)[N]) {
    std::array<TensorArg, N> args;
    for (std::size_t i = 0; i < N; ++i) args[i] = tensor_arg(names[i], objs[i]);
    return args;
}

inline cudaStream_t stream_arg(py::handle obj) {
    int64_t value = 0;
    if (int64_of(obj.ptr(), &value) && value >= 0) {
        return reinterpret_cast<cudaStream_t>(static_cast<std::uintptr_t>(value));
    }
    ASTRAI_CHECK(py::isinstance<py::int_>(obj) && obj.cast<py::int_>() >= py::int_(0),
                 "stream: expected the stream handle as a non-negative int");
    return reinterpret_cast<cudaStream_t>(obj.cast<std::uintptr_t>());
}

inline py::list to_list(const std::vector<std::string>& items) {
    py::list out;
    for (const auto& item : items) out.append(item);
    return out;
}

inline py::dict build_info() {
    py::dict info;
    const int runtime = CUDART_VERSION;
    info["cuda_version"] = std::to_string(runtime / 1000) + "." + std::to_string(runtime % 1000 / 10);
    info["nvcc_version"] = std::string(ASTRAI_BUILD_NVCC);
    const auto sass = split_list(ASTRAI_BUILD_SASS);
    const auto ptx = split_list(ASTRAI_BUILD_PTX);
    info["sass_archs"] = to_list(sass);
    info["ptx_archs"] = to_list(ptx);
    std::vector<std::string> archs;  // CMake-style list: 90a-real, 90-virtual
    for (const auto& a : sass) archs.push_back(a.substr(3) + "-real");
    for (const auto& a : ptx) archs.push_back(a.substr(8) + "-virtual");
    info["archs"] = to_list(archs);
#ifdef ASTRAI_NO_MMA
    info["no_mma"] = true;
#else
    info["no_mma"] = false;
#endif
    return info;
}

// Call first in every PYBIND11_MODULE of a plugin.
inline void init_module(py::module_& m) {
    py::register_local_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const InvalidArgument& e) {
            PyErr_SetString(PyExc_ValueError, e.what());
        } catch (const CudaError& e) {
            // A RuntimeError carrying the cudaError_t: callers decide by the code
            // (exc.cuda_error, exc.cuda_error_name), never by the message text.
            py::object exc = py::reinterpret_borrow<py::object>(PyExc_RuntimeError)(e.what());
            exc.attr("cuda_error") = static_cast<int>(e.code());
            exc.attr("cuda_error_name") = cudaGetErrorName(e.code());
            PyErr_SetObject(PyExc_RuntimeError, exc.ptr());
        }
    });
    m.def("build_info", &build_info,
          "What this module was built with: cuda_version, nvcc_version, sass_archs, "
          "ptx_archs, archs, no_mma.");
}

}  // namespace astrai::bind
