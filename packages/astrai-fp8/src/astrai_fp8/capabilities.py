"""What the FP8 plugin's kernels serve, stated once.

The manifest (``astrai_fp8.manifest``) is built from these names, and the C++ reads them
through ``csrc/capabilities.h``, which ``csrc/gen_capabilities.py`` writes from this file:
the argument checks, their error messages and the module's doc strings. The CMake build
passes ``MIN_SM``. cuda-common's ``kMinSmForFp8`` / ``kMinSmForWgmma`` (astrai/device.cuh),
the mma.sync kernel's arch guard and the Hopper entry's device check are written by hand;
tests/fp8/test_fp8_capabilities.py fails when any of them disagrees.

Plain data, no imports: the generator loads this file by path.
"""

# the two OCP formats (torch names): fp8_gemm's a and b (either format each), the quantize's
# output, the weight GEMM's weights
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# x of fp8_quantize
QUANTIZE_DTYPES = ("float32", "float16", "bfloat16")
# the amax history and scales of fp8_scale_update
SCALE_UPDATE_DTYPES = ("float32",)
# x and y of fp8_weight_gemm, x of quantize_rows (the W8A8 route's per-token quantize)
ACTIVATION_DTYPES = ("bfloat16", "float16")
# the lowest arch of every op (e4m3/e5m2 conversions and mma.sync m16n8k32)
MIN_SM = 89
# archs whose mma.sync e4m3/e5m2 is a native QMMA (elsewhere an fp16 emulation)
MMA_SYNC_NATIVE_SM = (89, 120)
# the arch of the Hopper wgmma + TMA mainloop (csrc/gemm/sm90), compiled for its a-target only
WGMMA_SM = 90
