// The rotary kernel: rotate channel pairs of up to three tensors ("slots") in one launch.
//
// For a pair (a, b) of channels and the angle of the token's row (c = cos[p, i], s = sin[p, i]):
//   a' = a * c - b * s
//   b' = a * s + b * c              (sign = -1 rotates backwards: the gradient)
// Interleaved (GPT-J): pair i is channels (2i, 2i + 1); NeoX: (i, i + rotary_dim / 2).
// Channels past rotary_dim are copied (nothing to do in place). The row p is positions[b, l]
// (int32 or int64, [L] or [B, L]) or l; a position outside [0, max_pos) gives NaN.
//
// A slot is one tensor [B, L, H, D] read through any strides (contiguous last dim) and
// written to an output of its shape, or, with `out_rows`, to row out_rows[l] of a
// [rows, H, D] table (a paged KV cache viewed flat). A slot whose rot_items is 0 only copies
// (the values written beside rotated keys). A slot with a `scale` writes fp8 (the kernel's
// kFp8 format) into such a table: each value rounded to T as the 16-bit write would store it,
// then round_to_fp8(x / scale) with saturation to the largest finite value, NaN kept (the
// bytes of the attention plugin's quantizing append and of PagedKVCache.append).
//
// Work items: kElems consecutive channels of one (token, head), i.e. one 16-byte access on
// the vector path (8 bf16/fp16, 4 fp32; NeoX items read kElems channels from each half),
// one element (or one interleaved pair) on the scalar path. Items of slot 0 come first, then
// slot 1, then slot 2; inside a slot in (b, l, h, item) order, so a warp reads contiguous
// memory. Each thread takes kItems items a block-width apart and issues all their loads
// before using any, so enough bytes are in flight to reach HBM bandwidth. cos/sin are read
// through the read-only cache (every head of a token reuses them); x is streamed (__ldcs).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "astrai/fast_divmod.cuh"
#include "elementwise.cuh"

namespace astrai::rotary {

inline constexpr int kMaxSlots = 3;

struct Slot {
    const void* in = nullptr;
    void* out = nullptr;
    int64_t in_stride_b = 0, in_stride_l = 0, in_stride_h = 0;  // elements
    int64_t out_stride_b = 0, out_stride_l = 0, out_stride_h = 0;
    const int64_t* out_rows = nullptr;  // per token l: the output row (stride out_stride_l)
    int64_t out_row_count = 0;          // rows of that table: a row outside it is not written
    uint32_t end = 0xffffffffu;         // one past this slot's last item (cumulative; unused: max)
    uint32_t rot_items = 0;             // items per head that rotate; the rest copy
    FastDivmod per_token;               // items per token: H * items per head
    FastDivmod per_head;                // items per head
    const float* scale = nullptr;       // fp8 output: dequantization scale of head h at h * scale_stride_h
    int64_t scale_stride_h = 0;
};

// The fp8 output format of a launch: none, e4m3 or e5m2.
enum class Fp8Out { None, E4M3, E5M2 };

struct RotaryParams {
    static constexpr int kThreads = 256;
    static constexpr int kItems = 2;

    Slot slot[kMaxSlots];
    int num_slots = 1;
    const float* cos = nullptr;
    const float* sin = nullptr;
    int64_t cos_stride = 0, sin_stride = 0;  // row strides, in floats
    const void* positions = nullptr;         // nullptr: row l
    int64_t pos_stride_b = 0, pos_stride_l = 0;
    bool pos_int64 = false;
    int64_t max_pos = 0;
    FastDivmod seq_len;  // L
    int32_t half = 0;    // rotary_dim / 2
    float sign = 1.f;
};

using elementwise::Cache;
using elementwise::from_float;
using elementwise::load;
using elementwise::store;
using elementwise::to_float;

// One work item between its loads and its stores.
template <typename T, bool kInterleaved, int kElems>
struct Item {
    static constexpr int kAngles = kInterleaved ? kElems / 2 : kElems;
    alignas(16) T a[kElems];                     // channels (interleaved) / first half (NeoX)
    alignas(16) T b[kInterleaved ? 1 : kElems];  // NeoX: the partner channels
    alignas(16) float c[kAngles];
    alignas(16) float s[kAngles];
    void* out_a;  // T, or one byte per value where `scale` > 0
    void* out_b;
    float scale;  // fp8 output: the head's dequantization scale; 0: writes T
    bool live;    // inside the launch's items
    bool rotate;  // else copy `a` (pass-through channels, values)
};

template <bool kVector, Fp8Out kFp8, typename T, bool kInterleaved, int kElems>
__device__ __forceinline__ void load_item(const RotaryParams& p, uint32_t g, uint32_t total,
                                          Item<T, kInterleaved, kElems>& it) {
    using ItemT = Item<T, kInterleaved, kElems>;
    constexpr int kData = kVector ? 16 : int(sizeof(T));
    constexpr int kAngleBytes = ItemT::kAngles * 4;
    constexpr int kAngle = kVector ? (kAngleBytes < 16 ? kAngleBytes : 16) : 4;
    it.live = g < total;
    if (!it.live) g = total - 1;  // past the end: load the last item again, store nothing
    // the slot by selects, not by a computed parameter address (which spills on sm_80)
    const bool past0 = g >= p.slot[0].end, past1 = g >= p.slot[1].end;
    const Slot s = past1 ? p.slot[2] : past0 ? p.slot[1] : p.slot[0];
    const uint32_t local = g - (past1 ? p.slot[1].end : past0 ? p.slot[0].end : 0u);
    uint32_t token, in_token, bi, l, h, i;
    s.per_token.divmod(local, token, in_token);
    p.seq_len.divmod(token, bi, l);
    s.per_head.divmod(in_token, h, i);
    const T* in = static_cast<const T*>(s.in) + (bi * s.in_stride_b + l * s.in_stride_l + h * s.in_stride_h);
    int64_t out_row = bi * s.out_stride_b + l * s.out_stride_l;
    if (s.out_rows != nullptr) {
        const int64_t row = __ldg(s.out_rows + l);
        it.live = it.live && row >= 0 && row < s.out_row_count;
        out_row = (it.live ? row : 0) * s.out_stride_l;
    }
    // element offsets of the output, in T or (fp8) in bytes
    const int64_t out_at = out_row + h * s.out_stride_h;
    it.scale = 0.f;
    if constexpr (kFp8 != Fp8Out::None) {
        if (s.scale != nullptr) it.scale = __ldg(s.scale + h * s.scale_stride_h);
    }
    auto out_ptr = [&](int64_t at) -> void* {
        if (kFp8 != Fp8Out::None && it.scale > 0.f) return static_cast<uint8_t*>(s.out) + (out_at + at);
        return static_cast<T*>(s.out) + (out_at + at);
    };
    it.rotate = i < s.rot_items;
    if (!it.rotate) {
        const int64_t first = (s.rot_items > 0 ? 2 * int64_t{p.half} : 0) + int64_t{i - s.rot_items} * kElems;
        load<kData, Cache::Stream>(in + first, it.a);
        it.out_a = out_ptr(first);
        return;
    }
    int64_t pos = l;
    if (p.positions != nullptr) {
        const int64_t at = bi * p.pos_stride_b + l * p.pos_stride_l;
        pos = p.pos_int64 ? __ldg(static_cast<const int64_t*>(p.positions) + at)
                          : int64_t{__ldg(static_cast<const int32_t*>(p.positions) + at)};
    }
    const int64_t first = int64_t{i} * kElems;
    const int64_t angle = kInterleaved ? int64_t{i} * (kElems / 2) : first;
    load<kData, Cache::Stream>(in + first, it.a);
    it.out_a = out_ptr(first);
    if constexpr (!kInterleaved) {
        load<kData, Cache::Stream>(in + p.half + first, it.b);
        it.out_b = out_ptr(p.half + first);
    }
    if (pos >= 0 && pos < p.max_pos) {
        load<kAngle, Cache::ReadOnly>(p.cos + pos * p.cos_stride + angle, it.c);
        load<kAngle, Cache::ReadOnly>(p.sin + pos * p.sin_stride + angle, it.s);
    } else {  // a bad row is loud, never a read outside the table
#pragma unroll
        for (int j = 0; j < ItemT::kAngles; ++j) it.c[j] = it.s[j] = __int_as_float(0x7fffffff);
    }
}

// kElems values of T to dst: as T (kData-byte accesses), or quantized to fp8 with `scale`
// (kElems bytes, one access: 8 for a vector of 8 16-bit values).
template <int kData, Fp8Out kFp8, typename T, int kElems>
__device__ __forceinline__ void write_values(void* dst, const T (&x)[kElems], float scale) {
    if constexpr (kFp8 != Fp8Out::None) {
        if (scale > 0.f) {
            constexpr __nv_fp8_interpretation_t kFmt = kFp8 == Fp8Out::E4M3 ? __NV_E4M3 : __NV_E5M2;
            alignas(8) uint8_t q[kElems];
#pragma unroll
            for (int j = 0; j < kElems; ++j)
                q[j] = __nv_cvt_float_to_fp8(__fdiv_rn(to_float(x[j]), scale), __NV_SATFINITE, kFmt);
            store<kElems>(static_cast<uint8_t*>(dst), q);
            return;
        }
    }
    store<kData>(static_cast<T*>(dst), x);
}

template <bool kVector, Fp8Out kFp8, typename T, bool kInterleaved, int kElems>
__device__ __forceinline__ void store_item(const RotaryParams& p, Item<T, kInterleaved, kElems>& it) {
    constexpr int kData = kVector ? 16 : int(sizeof(T));
    if (!it.live) return;
    if (!it.rotate) {
        write_values<kData, kFp8>(it.out_a, it.a, it.scale);
        return;
    }
    alignas(16) T ra[kElems];
    if constexpr (kInterleaved) {
#pragma unroll
        for (int j = 0; j < kElems / 2; ++j) {
            const float x0 = to_float(it.a[2 * j]), x1 = to_float(it.a[2 * j + 1]);
            const float c = it.c[j], s = p.sign * it.s[j];
            ra[2 * j] = from_float<T>(x0 * c - x1 * s);
            ra[2 * j + 1] = from_float<T>(x0 * s + x1 * c);
        }
        write_values<kData, kFp8>(it.out_a, ra, it.scale);
    } else {
        alignas(16) T rb[kElems];
#pragma unroll
        for (int j = 0; j < kElems; ++j) {
            const float x0 = to_float(it.a[j]), x1 = to_float(it.b[j]);
            const float c = it.c[j], s = p.sign * it.s[j];
            ra[j] = from_float<T>(x0 * c - x1 * s);
            rb[j] = from_float<T>(x0 * s + x1 * c);
        }
        write_values<kData, kFp8>(it.out_a, ra, it.scale);
        write_values<kData, kFp8>(it.out_b, rb, it.scale);
    }
}

// Items per thread: kItems, or one where the stores quantize to fp8 (each IEEE division's slow
// path is a call; a second item's loads held across them spilled the NeoX vector kernel on sm_80).
template <Fp8Out kFp8>
inline constexpr int kItemsPerThread = kFp8 == Fp8Out::None ? RotaryParams::kItems : 1;

template <typename T, bool kInterleaved, bool kVector>
struct Layout {
    // channels per item: one 16-byte access, or one element (one pair when interleaved)
    static constexpr int kElems = kVector ? int(16 / sizeof(T)) : (kInterleaved ? 2 : 1);
};

template <typename T, bool kInterleaved, bool kVector, Fp8Out kFp8 = Fp8Out::None>
__global__ void __launch_bounds__(RotaryParams::kThreads)
rotary_kernel(const RotaryParams p) {
    constexpr int kElems = Layout<T, kInterleaved, kVector>::kElems;
    constexpr uint32_t kThreads = RotaryParams::kThreads;
    constexpr int kItems = kItemsPerThread<kFp8>;
    const uint32_t total = p.slot[p.num_slots - 1].end;
    const uint32_t base = blockIdx.x * (kThreads * kItems) + threadIdx.x;
    Item<T, kInterleaved, kElems> items[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) load_item<kVector, kFp8>(p, base + k * kThreads, total, items[k]);
#pragma unroll
    for (int k = 0; k < kItems; ++k) store_item<kVector, kFp8>(p, items[k]);
}

}  // namespace astrai::rotary
