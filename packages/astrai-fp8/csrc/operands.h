// Argument checks the GEMM bindings share (ops.cu, gemm_rowwise.cu): each names the argument
// and what was expected (astrai::InvalidArgument, a Python ValueError).
#pragma once

#include <cstdint>
#include <limits>

#include "astrai/check.h"
#include "astrai/tensor_arg.h"
#include "common.h"

namespace astrai::fp8 {

inline FP8Format format_of(DType t) { return t == DType::Float8E4M3 ? FP8Format::E4M3 : FP8Format::E5M2; }

inline void expect_scalar_f32(const TensorArg& t) {
  expect_dtype(t, DType::Float32);
  ASTRAI_CHECK(t.numel() == 1, t.name, ": expected one element, got shape ", shape_str(t.shape));
  expect_data(t, 4);
}

// A 2-D operand stored row-major with unit column stride: returns its row stride.
inline int64_t expect_matrix(const TensorArg& t) {
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  expect_ndim(t, 2);
  ASTRAI_CHECK(t.size(0) > 0 && t.size(1) > 0, t.name, ": zero-size dimension in shape ",
               shape_str(t.shape));
  ASTRAI_CHECK(t.size(0) <= kIntMax && t.size(1) <= kIntMax, t.name, ": dimensions must fit int32, got ",
               shape_str(t.shape));
  expect_last_dim_contiguous(t);
  const int64_t ld = t.size(0) == 1 ? t.size(1) : t.stride(0);
  ASTRAI_CHECK(ld >= t.size(1), t.name, ": rows overlap (row stride ", ld, " < ", t.size(1),
               " columns); pass a contiguous tensor");
  expect_data(t, 1);
  return ld;
}

}  // namespace astrai::fp8
