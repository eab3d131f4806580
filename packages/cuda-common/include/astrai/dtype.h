// Dtype codes of the compiled call convention (ABI 1, docs/plugins.md section 4).
// The numbers are part of the ABI: mirrored by astrai.extension.abi.DTYPE_CODES.
#pragma once

#include <cstdint>

#include "astrai/check.h"

namespace astrai {

enum class DType : int32_t {
    Float32 = 0,
    Float16 = 1,
    BFloat16 = 2,
    Float8E4M3 = 3,
    Float8E5M2 = 4,
    Int32 = 5,
    Int64 = 6,
    Bool = 7,
};

inline constexpr int32_t kNumDTypes = 8;

// The torch name of a dtype, as manifests and messages spell it.
constexpr const char* dtype_name(DType t) {
    switch (t) {
        case DType::Float32: return "float32";
        case DType::Float16: return "float16";
        case DType::BFloat16: return "bfloat16";
        case DType::Float8E4M3: return "float8_e4m3fn";
        case DType::Float8E5M2: return "float8_e5m2";
        case DType::Int32: return "int32";
        case DType::Int64: return "int64";
        case DType::Bool: return "bool";
    }
    return "unknown";
}

constexpr int dtype_size(DType t) {
    switch (t) {
        case DType::Float32: return 4;
        case DType::Float16: return 2;
        case DType::BFloat16: return 2;
        case DType::Float8E4M3: return 1;
        case DType::Float8E5M2: return 1;
        case DType::Int32: return 4;
        case DType::Int64: return 8;
        case DType::Bool: return 1;
    }
    return 0;
}

inline bool is_fp8(DType t) { return t == DType::Float8E4M3 || t == DType::Float8E5M2; }

// A dtype code from Python, checked: `arg` names the argument in the error.
inline DType dtype_from_code(int64_t code, const char* arg) {
    ASTRAI_CHECK(code >= 0 && code < kNumDTypes, arg, ": unknown dtype code ", code,
                 " (ABI 1 codes are 0..", kNumDTypes - 1, ")");
    return static_cast<DType>(code);
}

}  // namespace astrai
