// The fp8_gemm kernels for A in e5m2, B in e4m3: every tile configuration x layout pair.
// One translation unit per format pair, so the build compiles the four in parallel.
#define ASTRAI_FP8_SPLIT_INSTANCES 1
#include "gemm.cuh"

namespace astrai::fp8 {
template void launch_tiles<FP8Format::E5M2, FP8Format::E4M3>(const CanonicalGemm&, const GemmPlan&,
                                                           cudaStream_t);
}  // namespace astrai::fp8
