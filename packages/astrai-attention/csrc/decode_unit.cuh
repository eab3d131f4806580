// Which work a decode block does, from its block index: blockIdx.x walks (request, KV head,
// head group) with the head group fastest, blockIdx.y is the split. Shared by the scalar and
// the MMA decode kernels (the launcher's grid: dispatchers.cuh).
#pragma once

#include "common.h"

namespace astrai::attn {

struct DecodeUnit {
    int unit, split;  // blockIdx.x, blockIdx.y
    int hgrp;         // the head group inside the KV head's query heads
    int kvh, b;       // the KV head and the request
    int head0, nh;    // the block's first query head and how many it serves (<= kHeads)
};

template <int kHeads>
__device__ __forceinline__ DecodeUnit decode_unit(const AttentionParams& p) {
    DecodeUnit u;
    u.unit = blockIdx.x, u.split = blockIdx.y;
    u.hgrp = u.unit % p.head_groups;
    u.kvh = (u.unit / p.head_groups) % p.kv_heads;
    u.b = u.unit / (p.head_groups * p.kv_heads);
    u.head0 = u.kvh * p.group + u.hgrp * kHeads;
    u.nh = min(kHeads, p.group - u.hgrp * kHeads);
    return u;
}

}  // namespace astrai::attn
