// Host-side checks shared by every plugin: one assert macro, typed errors.
//
//   ASTRAI_CHECK(cond, msg...)      throws astrai::InvalidArgument (Python ValueError)
//   ASTRAI_CUDA_CHECK(expr)         throws astrai::CudaError (Python RuntimeError)
//   ASTRAI_CHECK_LAUNCH()           checks the launch just issued (cudaGetLastError)
//
// Messages lead with what the caller must fix ("x: head_dim must be even, got 63"),
// then say which check failed and where: "[check `head_dim % 2 == 0` at rotary_emb.cu:88]".
// Validation runs before any CUDA call, so it also works on a machine without a GPU.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace astrai {

// Base of every error a plugin raises on purpose.
class Error : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// A caller passed something the op cannot take. Raised before any launch.
class InvalidArgument : public Error {
  public:
    using Error::Error;
};

// The CUDA runtime reported a failure (launch, configuration, device state).
class CudaError : public Error {
  public:
    CudaError(cudaError_t code, const std::string& what) : Error(what), code_(code) {}
    cudaError_t code() const noexcept { return code_; }

  private:
    cudaError_t code_;
};

namespace detail {

// Message pieces are appended without iostreams: a module built on one machine with
// ostream templates instantiated inline crashed formatting numbers against another
// libstdc++ (seen on the CUDA machine's image); std::to_string / plain appends are safe.
struct Hex {
    unsigned long long value;
};

inline void append(std::string& s, const char* v) { s += v ? v : "(null)"; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
inline void append(std::string& s, Hex v) {
    char buf[2 + 16 + 1];
    std::snprintf(buf, sizeof(buf), "0x%llx", v.value);
    s += buf;
}
template <typename T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool> &&
                                           !std::is_same_v<T, char>, int> = 0>
void append(std::string& s, T v) {
    s += std::to_string(v);
}
template <typename T, std::enable_if_t<std::is_enum_v<T>, int> = 0>
void append(std::string& s, T v) {
    s += std::to_string(static_cast<std::underlying_type_t<T>>(v));
}

template <typename... Parts>
std::string concat(Parts&&... parts) {
    std::string out;
    (append(out, std::forward<Parts>(parts)), ...);
    return out;
}

inline const char* basename(const char* path) {
    const char* base = path;
    for (const char* p = path; *p != '\0'; ++p) {
        if (*p == '/' || *p == '\\') base = p + 1;
    }
    return base;
}

[[noreturn]] inline void fail_check(const char* file, int line, const char* cond,
                                    const std::string& msg) {
    throw InvalidArgument(concat(msg.empty() ? std::string("invalid argument") : msg,
                                 " [check `", cond, "` at ", basename(file), ":", line, "]"));
}

[[noreturn]] inline void fail_cuda(const char* file, int line, const char* expr,
                                   cudaError_t code) {
    throw CudaError(code, concat("CUDA error ", cudaGetErrorName(code), ": ",
                                 cudaGetErrorString(code), " [`", expr, "` at ",
                                 basename(file), ":", line, "]"));
}

}  // namespace detail
}  // namespace astrai

#define ASTRAI_CHECK(cond, ...)                                                          \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            ::astrai::detail::fail_check(__FILE__, __LINE__, #cond,                      \
                                         ::astrai::detail::concat(__VA_ARGS__));         \
        }                                                                                \
    } while (0)

#define ASTRAI_CUDA_CHECK(expr)                                                          \
    do {                                                                                 \
        const cudaError_t astrai_status_ = (expr);                                       \
        if (astrai_status_ != cudaSuccess) {                                             \
            ::astrai::detail::fail_cuda(__FILE__, __LINE__, #expr, astrai_status_);      \
        }                                                                                \
    } while (0)

// After a <<<...>>> launch: configuration errors surface here, synchronously.
#define ASTRAI_CHECK_LAUNCH() ASTRAI_CUDA_CHECK(cudaGetLastError())
