// Architecture facts shared by the plugins, for device code and for host checks.
//
//   sm_at_least(sm)    device code: the arch being compiled is at least `sm` (major*10+minor)
//   device_sm(dev)     host: the compute capability of a device, as major*10+minor
//   device_attribute(attr, dev), current_device(), multiprocessor_count(dev)
//                      host queries that throw CudaError without a device
//   cached_device_attribute<attr>(), current_device_sm()
//                      the current device's, asked of the driver once per device
//   query_current_device({{attr, &value}, ...})
//                      the same queries without throwing, for paths that fall back instead
//   kMinSmFor*         the lowest arch each feature needs
//   kMmaEnabled        false when the build passed ASTRAI_NO_MMA (scalar fallbacks only)
//   built_for_sm90()   the translation unit holds sm_90a kernels (wgmma, TMA)
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <initializer_list>

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

// Whether this translation unit holds the sm_90a kernels. Plugin builds say so (ASTRAI_SM90A,
// set by the CMake helper from the SASS list: plain sm_90 SASS or compute_90 PTX only carry
// trap stubs); a bare nvcc build (the standalone tests) is asked through nvcc's host-pass list
// of device archs (__CUDA_ARCH_LIST__), which shows 900 for sm_90 and sm_90a alike: without
// 900 there is nothing to launch.
inline constexpr bool built_for_sm90() {
#if defined(ASTRAI_SM90A)
    return ASTRAI_SM90A != 0;
#elif defined(__CUDA_ARCH_LIST__)
    constexpr int archs[] = {__CUDA_ARCH_LIST__};
    for (int arch : archs)
        if (arch == 900) return true;
#endif
    return false;
}

// An attribute of `device` (cudaDevAttr*); throws CudaError without a device.
inline int device_attribute(cudaDeviceAttr attr, int device) {
    int value = 0;
    ASTRAI_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
    return value;
}

// Compute capability of `device` (major*10+minor); throws CudaError without a device.
inline int device_sm(int device) {
    const int major = device_attribute(cudaDevAttrComputeCapabilityMajor, device);
    const int minor = device_attribute(cudaDevAttrComputeCapabilityMinor, device);
    return major * 10 + minor;
}

inline int current_device() {
    int device = 0;
    ASTRAI_CUDA_CHECK(cudaGetDevice(&device));
    return device;
}

inline int multiprocessor_count(int device) { return device_attribute(cudaDevAttrMultiProcessorCount, device); }

// An attribute of the current device, asked of the driver once per device (launchers ask on
// every call); throws CudaError without a device.
template <cudaDeviceAttr kAttr>
int cached_device_attribute() {
    constexpr int kMaxDevices = 64;
    static std::atomic<int> cache[kMaxDevices];  // value + 1; 0: not asked yet (static: zero-initialized)
    const int dev = current_device();
    std::atomic<int>& slot = cache[dev % kMaxDevices];
    const int cached = slot.load(std::memory_order_relaxed);
    if (cached != 0) return cached - 1;
    const int value = device_attribute(kAttr, dev);
    slot.store(value + 1, std::memory_order_relaxed);
    return value;
}

// The current device's compute capability as 10 * major + minor, asked once per device.
inline int current_device_sm() {
    return 10 * cached_device_attribute<cudaDevAttrComputeCapabilityMajor>() +
           cached_device_attribute<cudaDevAttrComputeCapabilityMinor>();
}

struct AttributeQuery {
    cudaDeviceAttr attr;
    int* value;
};

// Reads each query's attribute of the current device into its value, in order, stopping at
// the first failure; returns that error, or cudaSuccess.
inline cudaError_t query_current_device(std::initializer_list<AttributeQuery> queries) {
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    for (const AttributeQuery& q : queries)
        if (e == cudaSuccess) e = cudaDeviceGetAttribute(q.value, q.attr, device);
    return e;
}

}  // namespace astrai
