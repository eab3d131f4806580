// Warp reductions and float atomics shared by the plugins.
#pragma once

namespace astrai {

// Reduces over the lanes l ^ 1, l ^ 2, ..., l ^ (Width/2): Width = 32 is a full warp,
// Width = 4 the quad that shares one row of an mma accumulator.
template <int Width = 32>
__device__ __forceinline__ float warp_reduce_max(float v) {
#pragma unroll
    for (int o = Width / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

template <int Width = 32>
__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
    for (int o = Width / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// atomicMax for non-negative and negative floats alike (sign-aware integer ordering).
__device__ __forceinline__ float atomic_max_float(float* addr, float v) {
    return v >= 0.f ? __int_as_float(atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v)))
                    : __uint_as_float(
                          atomicMin(reinterpret_cast<unsigned int*>(addr), __float_as_uint(v)));
}

}  // namespace astrai
