// Every instantiation of the decode bodies behind a knob that is off by default
// (ASTRAI_DECODE_FP8_SWAP_AB: decode_swap_ab.cuh), so that the CPU tests compile them and
// check ptxas's report (no spills) before a GPU run turns the knob on. Nothing runs here.
//   nvcc -std=c++17 -I csrc -I ../cuda-common/include -gencode=arch=compute_90a,code=sm_90a -O3 \
//        --use_fast_math --expt-relaxed-constexpr -Xptxas -v -c csrc/tests/pending_decode_knobs.cu -o /dev/null
#include "../decode_split_kv_mma.cuh"
#include "../layout_policies.cuh"

namespace attn = astrai::attn;

#define ASTRAI_SWAPPED(T, D, CAP, FMT) \
    template __global__ void attn::decode_mma_kernel<T, D, attn::PagedKV, CAP, attn::FMT, true>(const attn::AttentionParams);
#define ASTRAI_SWAPPED_ALL(T, D)                                                                  \
    ASTRAI_SWAPPED(T, D, false, KvE4M3) ASTRAI_SWAPPED(T, D, true, KvE4M3) ASTRAI_SWAPPED(T, D, false, KvE5M2) \
    ASTRAI_SWAPPED(T, D, true, KvE5M2)

ASTRAI_SWAPPED_ALL(__half, 64)
ASTRAI_SWAPPED_ALL(__half, 128)
ASTRAI_SWAPPED_ALL(__half, 256)
ASTRAI_SWAPPED_ALL(__nv_bfloat16, 64)
ASTRAI_SWAPPED_ALL(__nv_bfloat16, 128)
ASTRAI_SWAPPED_ALL(__nv_bfloat16, 256)
