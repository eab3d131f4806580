// gemm_rowwise's binding (gemm_rowwise.h): checks every argument before the one launch.
#include "gemm_rowwise.h"

#include <cstdint>

#include "astrai/bind.h"
#include "astrai/check.h"
#include "astrai/tensor_arg.h"
#include "capabilities.h"
#include "gemm/sm90/entry.h"
#include "operands.h"

namespace astrai::fp8 {
namespace {

void expect_scales(const TensorArg& t, int64_t n, const char* what) {
  expect_dtype(t, DType::Float32);
  expect_shape(t, {n}, what);
  expect_contiguous(t);
  expect_data(t, 4);
}

}  // namespace

void gemm_rowwise(pybind11::handle a_arg, pybind11::handle b_arg, pybind11::handle a_scale_arg,
                  pybind11::handle b_scale_arg, pybind11::handle out_arg, pybind11::handle stream_arg) {
  const auto [a, b, a_scale, b_scale, out] = bind::tensor_args(
      {"a", "b", "a_scale", "b_scale", "out"}, {a_arg, b_arg, a_scale_arg, b_scale_arg, out_arg});
  const cudaStream_t stream = bind::stream_arg(stream_arg);
  ASTRAI_CHECK(is_fp8_dtype(a.dtype), "a: expected " ASTRAI_FP8_DTYPES_TEXT ", got ", dtype_name(a.dtype));
  ASTRAI_CHECK(is_fp8_dtype(b.dtype), "b: expected " ASTRAI_FP8_DTYPES_TEXT ", got ", dtype_name(b.dtype));
  const int64_t lda = expect_matrix(a), ldb = expect_matrix(b);
  const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
  ASTRAI_CHECK(b.size(1) == k, "b: expected [N, ", k, "] (K as a's), got ", shape_str(b.shape));
  expect_scales(a_scale, m, "[M] (one scale per row of a)");
  expect_scales(b_scale, n, "[N] (one scale per row of b)");
  expect_dtype(out, DType::BFloat16);
  const int64_t ldc = expect_matrix(out);
  expect_shape(out, {m, n}, "[M, N]");
  expect_data(out, 2);
  for (const TensorArg* read : {&a, &b, &a_scale, &b_scale})
    ASTRAI_CHECK(!spans_overlap(out, *read), "out: overlaps ", read->name);

  const sm90::EntryResult r = sm90::gemm_entry(
      a.data<const uint8_t>(), lda, false, static_cast<int>(format_of(a.dtype)), b.data<const uint8_t>(), ldb, true,
      static_cast<int>(format_of(b.dtype)), out.data<uint16_t>(), ldc, nullptr, nullptr, m, n, k, /*promote=*/true,
      stream, a_scale.data<const float>(), b_scale.data<const float>());
  ASTRAI_CHECK(r.status != sm90::EntryStatus::NotApplicable, "gemm_rowwise: the sm_90a kernel cannot take it: ",
               r.message);
  ASTRAI_CHECK(r.status == sm90::EntryStatus::Launched, "gemm_rowwise (sm_90 wgmma): ", r.message);
}

}  // namespace astrai::fp8
