"""What the attention kernels serve, stated once.

The manifest (``astrai_attention.manifest``) is built from these names, and the C++ reads
them through ``csrc/capabilities.h``, which ``csrc/gen_capabilities.py`` writes from this
file: the dispatch switches over head dims and page dtypes, the kernels' static_asserts, the
argument checks and their error messages, and the modules' ``KV_DTYPES`` / ``VARIANTS``.
``csrc/gen_wgmma.py`` takes its P.V widths from ``HEAD_DIMS``; the CMake build passes
``MIN_SM``. tests/attention/test_attention_capabilities.py fails when any of them disagrees.

Plain data, no imports: the generators load this file by path.
"""

# compute dtypes of q, k, v and out (torch names)
DTYPES = ("bfloat16", "float16")
# head_dim of every op, each an instantiation of every kernel
HEAD_DIMS = (64, 128, 256)
# page dtypes the paged ops read besides DTYPES, with the layer's scales (csrc/kv_fp8.cuh);
# builds without the mma kernels (ASTRAI_NO_MMA) read none
FP8_KV_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# the variant features every kernel applies (csrc/variant.cuh; the modules' `variant` argument)
VARIANTS = ("window_left", "logits_soft_cap", "sinks", "alibi_slopes", "scale")
# the lowest arch the kernels are built for (cp.async, bf16 mma.sync)
MIN_SM = 80
