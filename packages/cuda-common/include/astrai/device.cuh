// Architecture facts shared by the plugins, for device code and for host checks.
//
//   sm_at_least(sm)    device code: the arch being compiled is at least `sm` (major*10+minor)
//   device_sm(dev)     host: the compute capability of a device, as major*10+minor
//   kMinSmFor*         the lowest arch each feature needs
//   kMmaEnabled        false when the build passed ASTRAI_NO_MMA (scalar fallbacks only)
#pragma once

#include <cuda_runtime_api.h>

#include "astrai/check.h"

namespace astrai {

inline constexpr int kMinSmForBf16Mma = 80;   // mma.sync m16n8k16 bf16/f16, cp.async, ldmatrix
inline constexpr int kMinSmForFp8 = 89;       // e4m3/e5m2 conversions and mma.sync m16n8k32
inline constexpr int kMinSmForWgmma = 90;     // wgmma, TMA (sm_90a binaries only)

#ifdef ASTRAI_NO_MMA
inline constexpr bool kMmaEnabled = false;
#else
inline constexpr bool kMmaEnabled = true;
#endif

// True in the device pass for an arch >= sm; false in the host pass.
__host__ __device__ constexpr bool sm_at_least(int sm) {
#if defined(__CUDA_ARCH__)
    return __CUDA_ARCH__ >= sm * 10;
#else
    return (void)sm, false;
#endif
}

// Compute capability of `device` (major*10+minor); throws CudaError without a device.
inline int device_sm(int device) {
    int major = 0, minor = 0;
    ASTRAI_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    ASTRAI_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    return major * 10 + minor;
}

inline int current_device() {
    int device = 0;
    ASTRAI_CUDA_CHECK(cudaGetDevice(&device));
    return device;
}

inline int multiprocessor_count(int device) {
    int sms = 0;
    ASTRAI_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms;
}

}  // namespace astrai
