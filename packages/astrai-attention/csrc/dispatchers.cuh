// Pure-CUDA launchers: pick the kernel instantiation for (dtype, head_dim), size the grid
// and shared memory, launch on the caller's stream and check the launch. The scalar
// kernels replace the mma ones in ASTRAI_NO_MMA builds. No torch, no pybind.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>

#include "astrai/check.h"
#include "astrai/device.cuh"
#include "astrai/dtype.h"
#include "capabilities.h"
#include "common.h"
#include "heuristics.h"
#include "decode_split_kv.cuh"
#include "decode_split_kv_mma.cuh"
#include "prefill_split_q.cuh"
#include "prefill_split_q_mma.cuh"
#include "prefill_ws.cuh"

namespace astrai::attn {

// Raises a kernel's dynamic shared-memory limit once per device.
template <typename Kernel>
void set_smem_limit(Kernel kernel, int bytes, std::atomic<uint64_t>& done) {
    const int dev = current_device();
    const uint64_t bit = uint64_t(1) << (dev & 63);
    if (done.load(std::memory_order_acquire) & bit) return;
    ASTRAI_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    done.fetch_or(bit, std::memory_order_release);
}

// Programmatic dependent launch needs sm_90+.
inline bool device_supports_pdl() { return current_device_sm() >= 90; }

// Launches kernel<<<grid, block, smem, stream>>>(p), programmatically (PDL) when `pdl`:
// its blocks may be scheduled while the stream's previous kernel drains, and wait for it in
// griddepcontrol.wait before touching memory.
template <typename Kernel>
void launch_pdl(Kernel kernel, dim3 grid, dim3 block, int smem, cudaStream_t stream, bool pdl,
                const AttentionParams& p) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = size_t(smem);
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    ASTRAI_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

// Whether the decode kernel appends a decode step's token itself (p.k_new): the mma kernel
// does; the scalar fallback doesn't, and its callers launch kv_append first.
#ifdef ASTRAI_NO_MMA
constexpr bool kDecodeAppendsInKernel = false;
#else
constexpr bool kDecodeAppendsInKernel = true;
#endif

// pdl: also launch the split grid with programmatic dependent launch on sm_90+ (the
// combine grid always is). Off by default. Measured on an H100 in CUDA graphs of
// back-to-back decode calls (bench_decode_latency.py, kv 4096, GQA 32/8 d128, the wait after
// the first page-id reads): B=1 with 32 splits 11.2 against 11.5 us without PDL (16 splits:
// 12.5-12.7 against 12.0-12.1), B=16 with one split 101.8-102.1 against 97.8 (4 % slower).
template <typename T, int D, class KV, class KvFmt = Kv16>
void launch_decode_d(const AttentionParams& p, cudaStream_t stream, bool pdl) {
    const dim3 grid(unsigned(p.batch) * p.kv_heads * p.head_groups, p.num_splits);
    const bool has_pdl = device_supports_pdl();
#ifdef ASTRAI_NO_MMA
    (void)pdl;
    static_assert(KvFmt::kBytes == 2, "the scalar decode reads 16-bit pages only (kDecodeKvDtypes)");
    decode_scalar_kernel<T, D, KV><<<grid, DecodeScalarConfig<D>::kThreads, 0, stream>>>(p);
    ASTRAI_CHECK_LAUNCH();
#else
    using C = DecodeMmaConfig<D, KvFmt::kBytes>;
    auto launch = [&](auto kernel, std::atomic<uint64_t>& done, int smem = C::kSmemBytes) {
        set_smem_limit(kernel, smem, done);
        launch_pdl(kernel, grid, dim3(C::kThreads), smem, stream, pdl && has_pdl, p);
    };
    static std::atomic<uint64_t> done[2][2] = {}, done_alibi{0};  // [swapped][capped]
    const bool capped = p.cap_log2 != 0.f, alibi = p.alibi_slopes != nullptr;
    bool swapped = false;
    // fp8 pages, GQA groups <= 8: the swapped-operand form (decode_swap_ab.cuh), 1.5-3 % faster
    // than the 16-row form on an H100 in three interleaved rounds at B = 1 and B = 16
    if constexpr (KvFmt::kBytes == 1) {
        swapped = p.group <= kSwapHeads && !alibi;
        if (swapped && capped) launch(decode_mma_kernel<T, D, KV, CappedVariant, KvFmt, true>, done[1][1]);
        else if (swapped) launch(decode_mma_kernel<T, D, KV, UncappedVariant, KvFmt, true>, done[1][0]);
    }
    if (alibi) launch(decode_mma_kernel<T, D, KV, AlibiVariant, KvFmt>, done_alibi);
    else if (!swapped && capped) launch(decode_mma_kernel<T, D, KV, CappedVariant, KvFmt>, done[0][1]);
    else if (!swapped) launch(decode_mma_kernel<T, D, KV, UncappedVariant, KvFmt>, done[0][0]);
    if (p.ws_count != nullptr) return;  // the kernel merged its own splits
#endif
    // The combine grid is scheduled while the split grid drains and waits in
    // griddepcontrol.wait, hiding a launch gap.
    if (p.num_splits > 1)
        launch_pdl(decode_combine_kernel<T, D>, dim3(unsigned(p.batch) * p.q_heads), dim3(decode_combine_threads(D)), 0,
                   stream, has_pdl, p);
}

template <typename T, int D, int WARPS, class QSched, class KV, class KvFmt = Kv16>
void launch_prefill_w(AttentionParams p, unsigned num_q_tiles, unsigned batch, cudaStream_t stream) {
    const PrefillGrid g = prefill_mma_grid(p, num_q_tiles, batch, WARPS);
    const dim3 grid(g.x, g.y, g.z);
    using C = PrefillMmaConfig<D, WARPS, KvFmt::kBytes>;
    static std::atomic<uint64_t> done{0};
    set_smem_limit(prefill_mma_kernel<T, D, WARPS, QSched, KV, KvFmt>, C::kSmemBytes, done);
    prefill_mma_kernel<T, D, WARPS, QSched, KV, KvFmt><<<grid, C::kThreads, C::kSmemBytes, stream>>>(p);
    ASTRAI_CHECK_LAUNCH();
}

// Whether the current device is an sm_90 (Hopper) GPU.
inline bool device_is_sm90() { return current_device_sm() == 90; }

// launch_prefill_d's layout value that forces the Hopper kernel where it applies.
constexpr int kPrefillWgmma = 90;

// One launch of the warp-specialized prefill with K/V tiles of PrefillWsConfig<D, BN>: its
// tensor maps, then the kernel (its variant instantiation where p has a window, soft-cap or
// sinks). False (nothing launched) where a TMA-only configuration's maps do not all encode.
template <typename T, int D, int BN, class QSched, class KV>
bool launch_prefill_ws_tiles(const AttentionParams& p, dim3 grid, cudaStream_t stream) {
    using C = PrefillWsConfig<D, BN>;  // the variant instantiation's copies and shared memory are the same
    PrefillTensorMaps maps;
    if constexpr (ASTRAI_PREFILL_TMA) {
        maps = KV::kPaged ? paged_kv_maps(p, D, C::kBN) : contig_kv_maps(p, D, C::kBN);
        maps.q_tma = encode_q_map(&maps.q, p, D, QSched::kPacked);
        maps.o_tma = ASTRAI_PREFILL_TMA_STORE && encode_o_map(&maps.o, p, D, QSched::kPacked);
    }
    if (C::kTmaOnly && !(maps.mode == PrefillTensorMaps::kTma && maps.q_tma)) return false;
    static std::atomic<uint64_t> done{0}, done_variant{0};
    if (has_score_variant(p)) {
        set_smem_limit(prefill_ws_kernel<T, D, QSched, KV, BN, RuntimeVariant>, C::kSmemBytes, done_variant);
        prefill_ws_kernel<T, D, QSched, KV, BN, RuntimeVariant><<<grid, C::kThreads, C::kSmemBytes, stream>>>(p, maps);
    } else {
        set_smem_limit(prefill_ws_kernel<T, D, QSched, KV, BN>, C::kSmemBytes, done);
        prefill_ws_kernel<T, D, QSched, KV, BN><<<grid, C::kThreads, C::kSmemBytes, stream>>>(p, maps);
    }
    ASTRAI_CHECK_LAUNCH();
    return true;
}

// The warp-specialized Hopper prefill (sm_90a) over prefill_ws_grid's blocks of 128 (row,
// head) pairs.
template <typename T, int D, class QSched, class KV>
void launch_prefill_ws(AttentionParams p, unsigned num_q_tiles, unsigned batch, cudaStream_t stream) {
    const PrefillGrid g = prefill_ws_grid(p, num_q_tiles, batch, QSched::kPacked, ASTRAI_PREFILL_WS_MHA != 0);
    dim3 grid(g.x, g.y, g.z);
    // Wide K/V tiles: dense calls over contiguous K/V (d128 without a causal mask, d256)
    constexpr int kWide = kWideTileRows<D>;
    if constexpr (kWide != 0 && !KV::kPaged && !QSched::kPacked) {
        if ((D == 256 || !p.causal) && !has_score_variant(p) &&
            launch_prefill_ws_tiles<T, D, kWide, QSched, KV>(p, grid, stream))
            return;
    }
    launch_prefill_ws_tiles<T, D, 0, QSched, KV>(p, grid, stream);
}

// layout = 0: the heuristic: the warp-specialized kernel where it applies (sm_90 device,
// sm_90a code, 16-bit pages, HB >= 2 or ASTRAI_PREFILL_WS_MHA), else prefill_warps' mma.sync
// layout. 4 or 8 forces that many mma.sync warps, kPrefillWgmma the Hopper kernel where it
// applies (benchmarks and tests). fp8 pages (KvFmt) run the mma.sync kernel.
template <typename T, int D, class QSched, class KV, class KvFmt = Kv16>
void launch_prefill_d(AttentionParams p, unsigned num_q_tiles, unsigned batch, cudaStream_t stream, int layout = 0) {
#ifdef ASTRAI_NO_MMA
    (void)layout;
    static_assert(KvFmt::kBytes == 2, "the scalar prefill reads 16-bit pages only (kPrefillReadsFp8)");
    p.blocks_per_tile = p.head_block;
    const dim3 grid(num_q_tiles * p.blocks_per_tile, p.kv_heads * p.head_groups, batch);
    prefill_scalar_kernel<T, D, QSched, KV><<<grid, 32 * kPrefillWarps, 0, stream>>>(p);
    ASTRAI_CHECK_LAUNCH();
#else
    if constexpr (built_for_sm90() && KvFmt::kBytes == 2) {
        if ((layout == 0 || layout == kPrefillWgmma) && (p.head_block >= 2 || ASTRAI_PREFILL_WS_MHA) &&
            device_is_sm90())
            return launch_prefill_ws<T, D, QSched, KV>(p, num_q_tiles, batch, stream);
    }
    const int warps = layout == 4 || layout == 8 ? layout : prefill_warps(p.group, D);
    if constexpr (D <= 128) {
        if (warps == 8 && p.head_block >= 2)
            return launch_prefill_w<T, D, 8, QSched, KV, KvFmt>(p, num_q_tiles, batch, stream);
    }
    launch_prefill_w<T, D, 4, QSched, KV, KvFmt>(p, num_q_tiles, batch, stream);
#endif
}

[[noreturn]] inline void bad_dtype_dim(DType dtype, int head_dim) {
    ASTRAI_CHECK(false, "unsupported dtype ", dtype_name(dtype), " / head_dim ", head_dim,
                 " (" ASTRAI_ATTN_DTYPES_TEXT "; " ASTRAI_ATTN_HEAD_DIMS_TEXT ")");
    throw;  // unreachable
}

template <typename T, class KV, class KvFmt = Kv16>
void decode_by_dim(const AttentionParams& p, int head_dim, cudaStream_t stream, bool pdl) {
    switch (head_dim) {
#define ASTRAI_CASE(D) \
    case D: return launch_decode_d<T, D, KV, KvFmt>(p, stream, pdl);
        ASTRAI_ATTN_HEAD_DIMS(ASTRAI_CASE)
#undef ASTRAI_CASE
    }
    bad_dtype_dim(DType::BFloat16, head_dim);
}

// The page dtypes the paged decode and prefill read besides the compute dtype (the modules'
// KV_DTYPES: ASTRAI_ATTN_FP8_KV_DTYPES): fp8 needs the mma kernels.
#ifdef ASTRAI_NO_MMA
constexpr bool kDecodeReadsFp8 = false;
#else
constexpr bool kDecodeReadsFp8 = true;
#endif
constexpr bool kPrefillReadsFp8 = kDecodeReadsFp8;

template <typename T, class KV>
void decode_by_kv_dtype(const AttentionParams& p, DType kv_dtype, int head_dim, cudaStream_t stream, bool pdl) {
    if constexpr (kDecodeReadsFp8 && KV::kPaged) {
#define ASTRAI_KV(DT, FMT) \
    if (kv_dtype == DType::DT) return decode_by_dim<T, KV, FMT>(p, head_dim, stream, pdl);
        ASTRAI_ATTN_FP8_KV_DTYPES(ASTRAI_KV)
#undef ASTRAI_KV
    }
    return decode_by_dim<T, KV>(p, head_dim, stream, pdl);
}

// The binding validated dtype, page dtype (kv_dtype: of K/V, fp8 or dtype) and head_dim; the
// fallthrough only guards a missed case.
template <class KV>
void dispatch_decode(const AttentionParams& p, DType dtype, int head_dim, cudaStream_t stream, bool pdl = false,
                     DType kv_dtype = DType::BFloat16) {
#define ASTRAI_DT(DT, T) \
    if (dtype == DType::DT) return decode_by_kv_dtype<T, KV>(p, kv_dtype, head_dim, stream, pdl);
    ASTRAI_ATTN_DTYPES(ASTRAI_DT)
#undef ASTRAI_DT
    bad_dtype_dim(dtype, head_dim);
}

template <typename T, class QSched, class KV, class KvFmt = Kv16>
void prefill_by_dim(const AttentionParams& p, int head_dim, unsigned num_q_tiles, unsigned batch,
                    cudaStream_t stream) {
    switch (head_dim) {
#define ASTRAI_CASE(D) \
    case D: return launch_prefill_d<T, D, QSched, KV, KvFmt>(p, num_q_tiles, batch, stream);
        ASTRAI_ATTN_HEAD_DIMS(ASTRAI_CASE)
#undef ASTRAI_CASE
    }
    bad_dtype_dim(DType::BFloat16, head_dim);
}

template <typename T, class QSched, class KV>
void prefill_by_kv_dtype(const AttentionParams& p, DType kv_dtype, int head_dim, unsigned num_q_tiles,
                         unsigned batch, cudaStream_t stream) {
    if constexpr (kPrefillReadsFp8 && KV::kPaged) {
#define ASTRAI_KV(DT, FMT) \
    if (kv_dtype == DType::DT) return prefill_by_dim<T, QSched, KV, FMT>(p, head_dim, num_q_tiles, batch, stream);
        ASTRAI_ATTN_FP8_KV_DTYPES(ASTRAI_KV)
#undef ASTRAI_KV
    }
    return prefill_by_dim<T, QSched, KV>(p, head_dim, num_q_tiles, batch, stream);
}

// kv_dtype as in dispatch_decode.
template <class QSched, class KV>
void dispatch_prefill(const AttentionParams& p, DType dtype, int head_dim, unsigned num_q_tiles,
                      unsigned batch, cudaStream_t stream, DType kv_dtype = DType::BFloat16) {
#define ASTRAI_DT(DT, T) \
    if (dtype == DType::DT) return prefill_by_kv_dtype<T, QSched, KV>(p, kv_dtype, head_dim, num_q_tiles, batch, stream);
    ASTRAI_ATTN_DTYPES(ASTRAI_DT)
#undef ASTRAI_DT
    bad_dtype_dim(dtype, head_dim);
}

}  // namespace astrai::attn
