// Policies that plug into the one kernel body per kind: the Q schedules (which rows a block
// takes: prefill_schedule.h, host and device code) and the KV sources. KV sources only give a
// request's KV length and the address of a logical position; they schedule nothing:
//   ContigKV  k[b, pos, h, :]
//   PagedKV   k_cache[kv_indices[kv_indptr[b] + pos / page_size], pos % page_size, h, :]
#pragma once

#include "common.h"
#include "prefill_schedule.h"

namespace astrai::attn {

// KV sources resolve a position in two steps so loaders can software-pipeline the
// dependent page-table read: fetch(pos) issues the (possibly global) lookup one tile ahead,
// offsets(handle, pos) is pure arithmetic when the copy is issued.
struct ContigKV {
    static constexpr bool kPaged = false;
    struct Request {
        int64_t k_base, v_base;
    };
    using Handle = int;
    __device__ static int kv_len(const AttentionParams& p, int /*b*/) { return p.kv_len; }
    __device__ static Request request(const AttentionParams& p, int b) {
        return {int64_t(b) * p.k_stride_b, int64_t(b) * p.v_stride_b};
    }
    __device__ static Handle fetch(const AttentionParams&, const Request&, int pos) { return pos; }
    // Element offsets of (position pos, kv head h) for K and for V.
    __device__ static void offsets(const AttentionParams& p, const Request& r, Handle, int pos, int h,
                                   int64_t& k_off, int64_t& v_off) {
        k_off = r.k_base + int64_t(pos) * p.k_stride_l + int64_t(h) * p.k_stride_h;
        v_off = r.v_base + int64_t(pos) * p.v_stride_l + int64_t(h) * p.v_stride_h;
    }
};

struct PagedKV {
    static constexpr bool kPaged = true;
    struct Request {
        const int32_t* pages;  // this request's page ids: kv_indices + kv_indptr[b]
        uint32_t magic;        // page_of(pos) = (umulhi(pos, magic) + pos) >> shift
        int shift;
    };
    using Handle = int;  // the page id holding the position
    __device__ static int kv_len(const AttentionParams& p, int b) { return p.kv_lens[b]; }
    // One reciprocal per block, so the per-position page lookup is branch-free for any
    // page size: magic = 0 and shift = log2(page) for a power of two; otherwise the
    // round-up reciprocal with shift = ceil(log2(page)), exact for 0 <= pos < 2^31.
    __device__ static Request request(const AttentionParams& p, int b) {
        Request r{p.kv_indices + p.kv_indptr[b], 0u, p.page_shift};
        if (p.page_shift < 0) {
            const uint32_t d = uint32_t(p.page_size);
            r.shift = 32 - __clz(d - 1);
            r.magic = uint32_t((uint64_t((uint64_t(1) << r.shift) - d) << 32) / d + 1);
        }
        return r;
    }
    __device__ static int page_of(const Request& r, int pos) {
        return int((__umulhi(uint32_t(pos), r.magic) + uint32_t(pos)) >> r.shift);
    }
    __device__ static Handle fetch(const AttentionParams&, const Request& r, int pos) {
        return __ldg(r.pages + page_of(r, pos));
    }
    __device__ static void offsets(const AttentionParams& p, const Request& r, Handle page, int pos, int h,
                                   int64_t& k_off, int64_t& v_off) {
        // Page ids, slots and strides are non-negative: unsigned 32 x 64-bit products are
        // two instructions each (a signed one needs the sign extension too).
        const uint64_t pg = uint32_t(page);
        const uint64_t slot = uint32_t(pos - page_of(r, pos) * p.page_size);
        k_off = int64_t(pg * uint64_t(p.k_stride_b) + slot * uint64_t(p.k_stride_l)) + int64_t(h) * p.k_stride_h;
        v_off = int64_t(pg * uint64_t(p.v_stride_b) + slot * uint64_t(p.v_stride_l)) + int64_t(h) * p.v_stride_h;
    }
};

}  // namespace astrai::attn
