// Tensor maps for the TMA loads, encoded with the driver's cuTensorMapEncodeTiled reached
// through cudaGetDriverEntryPointByVersion (astrai/tensor_map.h): the module links no libcuda.
#pragma once

#include "astrai/tensor_map.h"

#include <cstdint>
#include <string>

namespace astrai::fp8::sm90 {

using astrai::encode_tiled_fn;
using astrai::EncodeTiledFn;

// Row-major fp8 matrix [rows, cols] with `ld` bytes between rows, read in boxes of
// box_rows x 128 bytes with the 128-byte swizzle the wgmma descriptors expect. Parts of a
// box outside the matrix are filled with zeros (the K tail and ragged M / N edges).
inline std::string encode_fp8_k_major(CUtensorMap* map, const void* base, int64_t rows,
                                      int64_t cols, int64_t ld, int box_rows) {
    const EncodeTiledFn fn = encode_tiled_fn();
    if (fn == nullptr) return "driver has no cuTensorMapEncodeTiled";
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld)};
    const cuuint32_t box[2] = {128u, static_cast<cuuint32_t>(box_rows)};
    const cuuint32_t elem_strides[2] = {1u, 1u};
    const CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims,
                          strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) return "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(r);
    return "";
}

}  // namespace astrai::fp8::sm90
