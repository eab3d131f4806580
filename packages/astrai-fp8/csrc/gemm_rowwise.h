// gemm_rowwise: the W8A8 GEMM with row-wise scales on the Hopper kernel (gemm_rowwise.cu).
#pragma once

#include <pybind11/pybind11.h>

namespace astrai::fp8 {

// out[M, N] (bf16) = (a_scale[m] * b_scale[n]) * sum_k a[m, k] * b[n, k]: a [M, K] (per-token
// activations) and b [N, K] (per-channel weights) fp8 with unit last stride, a_scale float32 [M],
// b_scale float32 [N] contiguous. Only the sm_90a wgmma kernel runs it: a call it cannot take
// raises with the planner's reason (callers check sm_90 and the shapes first).
void gemm_rowwise(pybind11::handle a, pybind11::handle b, pybind11::handle a_scale, pybind11::handle b_scale,
                  pybind11::handle out, pybind11::handle stream);

}  // namespace astrai::fp8
