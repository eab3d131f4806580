"""What the element-wise plugin's kernels (rotary embedding, the norms, SiLU-and-mul) serve, stated once.

The manifest (``astrai_elementwise.manifest``) is built from these names, and the C++ reads
them through ``csrc/capabilities.h``, which ``csrc/gen_capabilities.py`` writes from this
file: the argument checks and their error messages, and the module's ``KV_DTYPES``. The
CMake build passes ``MIN_SM``. tests/rotary/test_rotary_capabilities.py fails when any of
them disagrees.

No head-dim or hidden-size list: the rotary ops take both pair layouts (interleaved and
NeoX), partial rotary and any even head_dim; the norm ops any hidden size (in registers up
to 32768 bf16/fp16 or 16384 fp32 channels, in two passes beyond).

Plain data, no imports: the generator loads this file by path.
"""

# dtypes of every op's tensors (torch names): rotated q / k, normed rows, gate / up; the
# core's policies read them from the manifest
DTYPES = ("float16", "bfloat16", "float32")
# page dtypes rope_paged_append writes besides DTYPES, quantized with the layer's scales
# (csrc/rotary_kernel.cuh; the module's KV_DTYPES)
FP8_KV_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# the dtypes of k and v an fp8 page is quantized from
FP8_KV_SOURCE_DTYPES = ("float16", "bfloat16")
# the dtype of the norm and SiLU-and-mul rows written with per-token scales (rms_norm_fp8,
# silu_and_mul_fp8: a W8A8 linear's input; csrc/row_fp8.cuh)
FP8_ROW_DTYPES = ("float8_e4m3fn",)
# the dtypes such rows are made from (a W8A8 route's 16-bit activations)
FP8_ROW_SOURCE_DTYPES = ("float16", "bfloat16")
# the lowest arch the kernels are built for (the release arch lists start there)
MIN_SM = 80
