// astrai_fp8._fp8_ops: the binding. Validation, parameter packing, dispatch; no kernels.
//
//   quantize(x, scale, q, q_t, amax, out_layout, stream)
//   quantize_rows(x, q, scale, stream)   q = e4m3(x / scale), scale[r] = amax(|x[r]|) / 448
//   gemm(a, b, scale, bias, out, trans_a, trans_b, stream, mainloop="auto")
//   gemm_rowwise(a, b, a_scale, b_scale, out, stream)   row-wise scales, sm_90a only (gemm_rowwise.cu)
//   scale_update(hist, pending, prev_scale, scale, scale_inv, factor, most_recent, stream)
//   weight_gemm(x, w, w_scale, y, ws, k_per_split, stream)   y = x (w * w_scale)^T, <= 64 rows of x
//   weight_gemm_plan(n, k, sms) -> k_per_split   (no GPU)
//   plan(m, n, k, trans_a, trans_b, sms, smem_per_sm, smem_per_block) -> dict   (no GPU)
//   sm90.plan(shape, device, accum, force_config) ...: the Hopper planner (planning_bind.h)
//   build_info() -> dict
// Tensors are tuples (data_ptr, shape, strides_in_elements, dtype_code) (ABI 1); bias may
// be None. Every argument is checked before the first CUDA call (ValueError naming it);
// the device must be sm_89+ (fp8 conversions and mma.sync m16n8k32).
#define ASTRAI_FP8_SPLIT_INSTANCES 1  // GEMM kernels live in instances/*.cu

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>

#include "astrai/bind.h"
#include "astrai/check.h"
#include "astrai/device.cuh"
#include "astrai/tensor_arg.h"
#include "capabilities.h"
#include "gemm.cuh"
#include "gemm_rowwise.h"
#include "gemm/sm90/entry.h"
#include "gemm/sm90/planning_bind.h"
#include "operands.h"
#include "quantize.cuh"
#include "quantize_rows.cuh"
#include "scale_update.cuh"
#include "weight_gemm.cuh"

namespace astrai::fp8 {
namespace py = pybind11;

namespace {

constexpr int64_t kIntMax = std::numeric_limits<int>::max();

// What the launches read of a device, queried once per device: every quantize and scale
// update checks the arch and the quantize sizes its grid by the SM count, and each
// cudaDeviceGetAttribute is a driver call on the FP8 linear's per-step host path (five per
// training step's calls before). A failed query (no device) throws, caches nothing and is
// retried on the next call (no std::call_once: an exception there hangs later calls with
// some libstdc++ versions).
struct DeviceFacts {
  int sm;
  DeviceLimits limits;
};

DeviceFacts query_device_facts(int device) { return {device_sm(device), device_limits(device)}; }

DeviceFacts device_facts(int device) {
  constexpr int kCached = 64;
  static std::atomic<bool> ready[kCached];
  static DeviceFacts facts[kCached];
  static std::mutex writing;
  if (device < 0 || device >= kCached) return query_device_facts(device);
  if (ready[device].load(std::memory_order_acquire)) return facts[device];
  const DeviceFacts queried = query_device_facts(device);
  std::lock_guard<std::mutex> lock(writing);
  if (!ready[device].load(std::memory_order_relaxed)) {
    facts[device] = queried;
    ready[device].store(true, std::memory_order_release);
  }
  return facts[device];
}

// The current device's facts, after checking it runs the fp8 ops.
DeviceFacts checked_device() {
  const DeviceFacts facts = device_facts(current_device());
  ASTRAI_CHECK(facts.sm >= kMinSmForFp8, "fp8 ops need an sm_", kMinSmForFp8,
               "+ GPU (e4m3/e5m2 conversions and mma.sync m16n8k32); this device is sm_", facts.sm);
  return facts;
}

// --------------------------------------------------------------------- quantize
void quantize(py::handle x_arg, py::handle scale_arg, py::handle q_arg, py::handle qt_arg,
              py::handle amax_arg, int out_layout, py::handle stream_arg) {
  const auto [x, scale, q, q_t, amax] =
      bind::tensor_args({"x", "scale", "q", "q_t", "amax"}, {x_arg, scale_arg, q_arg, qt_arg, amax_arg});
  const cudaStream_t stream = bind::stream_arg(stream_arg);

  ASTRAI_CHECK(out_layout >= 0 && out_layout <= 2, "out_layout: expected 0 (q), 1 (q_t) or 2 (both), got ",
               out_layout);
  ASTRAI_CHECK(is_quantize_dtype(x.dtype), "x: expected " ASTRAI_FP8_QUANTIZE_DTYPES_TEXT ", got ",
               dtype_name(x.dtype));
  const int64_t ldx = expect_matrix(x);
  ASTRAI_CHECK(x.ptr % dtype_size(x.dtype) == 0, "x: data pointer not aligned to its element size");
  expect_scalar_f32(scale);
  expect_scalar_f32(amax);
  const int64_t rows = x.size(0), cols = x.size(1);
  const bool want_q = out_layout != 1, want_qt = out_layout != 0;
  ASTRAI_CHECK(is_fp8_dtype(q.dtype) && is_fp8_dtype(q_t.dtype), "q, q_t: expected " ASTRAI_FP8_DTYPES_TEXT ", got ",
               dtype_name(q.dtype), " and ", dtype_name(q_t.dtype));
  if (want_q) {
    expect_shape(q, {rows, cols}, "[M, K] like x");
    ASTRAI_CHECK(q.stride(1) == 1 && (rows == 1 || q.stride(0) == cols), "q: must be contiguous");
    expect_data(q, 1);
  } else {
    ASTRAI_CHECK(q.numel() == 0, "q: must be empty when out_layout is 1");
  }
  if (want_qt) {
    expect_shape(q_t, {cols, rows}, "[K, M] (x transposed)");
    ASTRAI_CHECK(q_t.stride(1) == 1 && (cols == 1 || q_t.stride(0) == rows), "q_t: must be contiguous");
    expect_data(q_t, 1);
    ASTRAI_CHECK(rows <= int64_t{65535} * kTransTile, "x: at most ", int64_t{65535} * kTransTile,
                 " rows for out_layout 1/2, got ", rows);
  }
  ASTRAI_CHECK(!(want_q && want_qt) || q.dtype == q_t.dtype, "q_t: dtype ", dtype_name(q_t.dtype),
               " differs from q's ", dtype_name(q.dtype));
  const DType out_dtype = want_q ? q.dtype : q_t.dtype;

  const int sms = checked_device().limits.sms;
  FP8QuantizeParams p{reinterpret_cast<const void*>(x.ptr),
                      want_q ? q.data<uint8_t>() : nullptr,
                      want_qt ? q_t.data<uint8_t>() : nullptr,
                      amax.data<float>(),
                      scale.data<const float>(),
                      static_cast<int>(rows),
                      static_cast<int>(cols),
                      ldx};
  const bool e4 = out_dtype == DType::Float8E4M3;
  switch (x.dtype) {
    case DType::Float32:
      return e4 ? quantize_launch<float, FP8Format::E4M3>(p, out_layout, sms, stream)
                : quantize_launch<float, FP8Format::E5M2>(p, out_layout, sms, stream);
    case DType::Float16:
      return e4 ? quantize_launch<__half, FP8Format::E4M3>(p, out_layout, sms, stream)
                : quantize_launch<__half, FP8Format::E5M2>(p, out_layout, sms, stream);
    default:
      return e4 ? quantize_launch<__nv_bfloat16, FP8Format::E4M3>(p, out_layout, sms, stream)
                : quantize_launch<__nv_bfloat16, FP8Format::E5M2>(p, out_layout, sms, stream);
  }
}

// --------------------------------------------------------------------- gemm
void gemm_op(py::handle a_arg, py::handle b_arg, py::handle scale_arg, py::handle bias_arg,
             py::handle out_arg, bool trans_a, bool trans_b, py::handle stream_arg,
             const std::string& mainloop) {
  ASTRAI_CHECK(mainloop == "auto" || mainloop == "mma_sync",
               "mainloop: expected 'auto' or 'mma_sync', got '", mainloop, "'");
  const auto [a, b, scale, out] = bind::tensor_args({"a", "b", "scale", "out"}, {a_arg, b_arg, scale_arg, out_arg});
  const bool has_bias = !bias_arg.is_none();
  TensorArg bias;
  if (has_bias) bias = bind::tensor_arg("bias", bias_arg);
  const cudaStream_t stream = bind::stream_arg(stream_arg);

  ASTRAI_CHECK(is_fp8_dtype(a.dtype), "a: expected " ASTRAI_FP8_DTYPES_TEXT ", got ", dtype_name(a.dtype));
  ASTRAI_CHECK(is_fp8_dtype(b.dtype), "b: expected " ASTRAI_FP8_DTYPES_TEXT ", got ", dtype_name(b.dtype));
  const int64_t lda = expect_matrix(a), ldb = expect_matrix(b);
  const int64_t m = trans_a ? a.size(1) : a.size(0), k = trans_a ? a.size(0) : a.size(1);
  const int64_t kb = trans_b ? b.size(1) : b.size(0), n = trans_b ? b.size(0) : b.size(1);
  ASTRAI_CHECK(k == kb, "b: inner dimensions differ: op(a) is [", m, ", ", k, "], op(b) is [", kb,
               ", ", n, "]");
  expect_scalar_f32(scale);
  expect_dtype(out, DType::BFloat16);
  const int64_t ldc = expect_matrix(out);
  expect_shape(out, {m, n}, "[M, N]");
  expect_data(out, 2);
  if (has_bias) {
    expect_dtype(bias, DType::BFloat16);
    expect_shape(bias, {n}, "[N]");
    ASTRAI_CHECK(bias.stride(0) == 1 || n == 1, "bias: must be contiguous");
    expect_data(bias, 2);
  }

  const DeviceFacts device = checked_device();
  // sm_90: the wgmma + TMA kernel takes the K-major problems it can; the rest fall through.
  // mainloop="mma_sync" skips it (tests and benchmarks of the mma.sync path on Hopper).
  if (mainloop == "auto") {
    const sm90::EntryResult hopper = sm90::gemm_entry(
        a.data<const uint8_t>(), lda, trans_a, static_cast<int>(format_of(a.dtype)),
        b.data<const uint8_t>(), ldb, trans_b, static_cast<int>(format_of(b.dtype)),
        out.data<uint16_t>(), ldc, has_bias ? bias.data<const uint16_t>() : nullptr,
        scale.data<const float>(), m, n, k, /*promote=*/true, stream);
    if (hopper.status == sm90::EntryStatus::Launched) return;
    ASTRAI_CHECK(hopper.status != sm90::EntryStatus::Failed, "fp8 gemm (sm_90 wgmma): ", hopper.message);
  }
  const GemmArgs g{a.data<const uint8_t>(), b.data<const uint8_t>(), out.data<uint16_t>(),
                   has_bias ? bias.data<const uint16_t>() : nullptr, scale.data<const float>(),
                   static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), lda, ldb, ldc,
                   trans_a, trans_b, format_of(a.dtype), format_of(b.dtype)};
  gemm(g, device.limits, stream);
}

// --------------------------------------------------------------------- scale_update
// A float32 contiguous tensor of `numel` elements (any shape), 4-byte aligned.
void expect_f32_vector(const TensorArg& t, int64_t numel) {
  expect_dtype(t, DType::Float32);
  ASTRAI_CHECK(t.numel() == numel, t.name, ": expected ", numel, " elements (one per history row), got shape ",
               shape_str(t.shape));
  expect_contiguous(t);
  expect_data(t, 4);
}

void scale_update(py::handle hist_arg, py::handle pending_arg, py::handle prev_arg, py::handle scale_arg,
                  py::handle inv_arg, double factor, bool most_recent, py::handle stream_arg) {
  const auto [hist, pending, prev, scale, inv] =
      bind::tensor_args({"hist", "pending", "prev_scale", "scale", "scale_inv"},
                        {hist_arg, pending_arg, prev_arg, scale_arg, inv_arg});
  const cudaStream_t stream = bind::stream_arg(stream_arg);

  expect_dtype(hist, DType::Float32);
  ASTRAI_CHECK(hist.ndim() >= 1, "hist: expected [..., L] with at least one dim, got a 0-d tensor");
  const int64_t len = hist.size(-1);
  ASTRAI_CHECK(len >= 1, "hist: the history length (last dim) must be >= 1, got shape ",
               shape_str(hist.shape));
  const int64_t rows = hist.numel() / len;
  ASTRAI_CHECK(rows >= 1, "hist: expected at least one row, got shape ", shape_str(hist.shape));
  ASTRAI_CHECK(rows <= kIntMax, "hist: at most ", kIntMax, " rows (the grid), got ", rows);
  expect_contiguous(hist);
  expect_data(hist, 4);
  expect_f32_vector(pending, rows);
  expect_f32_vector(prev, rows);
  expect_f32_vector(scale, rows);
  expect_f32_vector(inv, rows);
  // Written tensors must not share memory; prev_scale may be scale itself (read first).
  const TensorArg* written[] = {&hist, &pending, &scale, &inv};
  for (int i = 0; i < 4; ++i)
    for (int j = i + 1; j < 4; ++j)
      ASTRAI_CHECK(!spans_overlap(*written[i], *written[j]), written[j]->name, ": overlaps ", written[i]->name);
  for (const TensorArg* w : written)
    ASTRAI_CHECK(!spans_overlap(prev, *w) || (w == &scale && prev.ptr == scale.ptr), "prev_scale: overlaps ",
                 w->name, " (it may only be scale itself)");

  checked_device();
  ScaleUpdateParams p{hist.data<float>(), pending.data<float>(), prev.data<const float>(),
                      scale.data<float>(), inv.data<float>(), static_cast<float>(factor),
                      rows, len, /*segment=*/0, most_recent ? 1 : 0};
  scale_update_launch(p, stream);
}

// --------------------------------------------------------------------- weight_gemm
// A matrix operand of the weight GEMM: 2-D, a contiguous last dim, rows 16-byte aligned.
int64_t expect_rows16(const TensorArg& t) {
  const int64_t ld = expect_matrix(t);
  const int64_t esize = dtype_size(t.dtype);
  ASTRAI_CHECK((ld * esize) % 16 == 0, t.name, ": rows must start 16 bytes apart (row stride ", ld,
               " elements of ", esize, " bytes)");
  expect_data(t, 16);
  return ld;
}

void weight_gemm(py::handle x_arg, py::handle w_arg, py::handle scale_arg, py::handle y_arg, py::handle ws_arg,
                 int64_t k_per_split, py::handle stream_arg) {
  const auto [x, w, w_scale, y] = bind::tensor_args({"x", "w", "w_scale", "y"}, {x_arg, w_arg, scale_arg, y_arg});
  const cudaStream_t stream = bind::stream_arg(stream_arg);
  ASTRAI_CHECK(is_activation_dtype(x.dtype), "x: expected " ASTRAI_FP8_ACTIVATION_DTYPES_TEXT ", got ",
               dtype_name(x.dtype));
  const int64_t ldx = expect_rows16(x);
  const int64_t m = x.size(0), k = x.size(1);
  ASTRAI_CHECK(m <= 64, "x: at most 64 rows (tokens) for the weight GEMM, got ", m);
  ASTRAI_CHECK(k % kWeightGemmChunk == 0, "x: K must be a multiple of ", kWeightGemmChunk, ", got ", k);
  ASTRAI_CHECK(is_fp8_dtype(w.dtype), "w: expected " ASTRAI_FP8_DTYPES_TEXT ", got ", dtype_name(w.dtype));
  const int64_t ldw = expect_rows16(w);
  ASTRAI_CHECK(w.size(1) == k, "w: expected [N, ", k, "] (K of x), got ", shape_str(w.shape));
  const int64_t n = w.size(0);
  expect_dtype(w_scale, DType::Float32);
  expect_shape(w_scale, {n}, "[N] (one scale per output channel)");
  expect_contiguous(w_scale);
  expect_data(w_scale, 4);
  expect_dtype(y, x.dtype);
  expect_shape(y, {m, n}, "[M, N]");
  const int64_t ldy = expect_matrix(y);
  expect_data(y, 2);
  ASTRAI_CHECK(k_per_split > 0 && k_per_split % kWeightGemmChunk == 0, "k_per_split: expected a positive multiple of ",
               kWeightGemmChunk, ", got ", k_per_split);
  WeightGemmParams p{};
  if (k_per_split < k) {
    ASTRAI_CHECK(!ws_arg.is_none(), "ws: K splits (k_per_split ", k_per_split, " < K ", k,
                 ") need the float32 [M, N] workspace, zero on entry");
    const TensorArg ws = bind::tensor_arg("ws", ws_arg);
    expect_dtype(ws, DType::Float32);
    expect_shape(ws, {m, n}, "[M, N]");
    expect_contiguous(ws);
    expect_data(ws, 4);
    p.ws = ws.data<float>();
  }
  checked_device();
  p.x = x.data<const void>(), p.w = w.data<const uint8_t>(), p.w_scale = w_scale.data<const float>();
  p.y = y.data<void>();
  p.x_stride = ldx, p.w_stride = ldw, p.y_stride = ldy;
  p.m = static_cast<int>(m), p.n = static_cast<int>(n), p.k = static_cast<int>(k);
  p.k_per_split = static_cast<int>(k_per_split);
  const bool e4m3 = w.dtype == DType::Float8E4M3;
  if (x.dtype == DType::BFloat16) {
    e4m3 ? launch_weight_gemm<__nv_bfloat16, 4>(p, stream) : launch_weight_gemm<__nv_bfloat16, 5>(p, stream);
  } else {
    e4m3 ? launch_weight_gemm<__half, 4>(p, stream) : launch_weight_gemm<__half, 5>(p, stream);
  }
  ASTRAI_CHECK_LAUNCH();
}

// --------------------------------------------------------------------- quantize_rows
void quantize_rows(py::handle x_arg, py::handle q_arg, py::handle scale_arg, py::handle stream_arg) {
  const auto [x, q, scale] = bind::tensor_args({"x", "q", "scale"}, {x_arg, q_arg, scale_arg});
  const cudaStream_t stream = bind::stream_arg(stream_arg);
  ASTRAI_CHECK(is_activation_dtype(x.dtype), "x: expected " ASTRAI_FP8_ACTIVATION_DTYPES_TEXT ", got ",
               dtype_name(x.dtype));
  const int64_t ldx = expect_rows16(x);
  const int64_t rows = x.size(0), cols = x.size(1);
  ASTRAI_CHECK(cols % 8 == 0, "x: K must be a multiple of 8, got ", cols);
  expect_dtype(q, DType::Float8E4M3);
  expect_shape(q, {rows, cols}, "[M, K] like x");
  const int64_t ldq = expect_matrix(q);
  ASTRAI_CHECK(ldq % 8 == 0, "q: rows must start 8 bytes apart (row stride ", ldq, ")");
  expect_data(q, 8);
  expect_dtype(scale, DType::Float32);
  expect_shape(scale, {rows}, "[M] (one scale per row of x)");
  expect_contiguous(scale);
  expect_data(scale, 4);
  checked_device();
  const FP8QuantizeRowsParams p{x.data<const void>(), q.data<uint8_t>(), scale.data<float>(), static_cast<int>(rows),
                                static_cast<int>(cols), ldx, ldq};
  x.dtype == DType::BFloat16 ? quantize_rows_launch<__nv_bfloat16>(p, stream) : quantize_rows_launch<__half>(p, stream);
}

int64_t weight_gemm_plan(int64_t n, int64_t k, int sms) {
  ASTRAI_CHECK(n > 0 && k > 0 && n <= kIntMax && k <= kIntMax && k % kWeightGemmChunk == 0,
               "n, k: expected positive int32 sizes with k a multiple of ", kWeightGemmChunk, ", got ", n, ", ", k);
  ASTRAI_CHECK(sms > 0, "sms: must be positive, got ", sms);
  return k / weight_gemm_splits(static_cast<int>(n), static_cast<int>(k), sms);
}

// --------------------------------------------------------------------- planner (pure)
const char* tile_name(TileConfig c) {
  switch (c) {
    case TileConfig::k64x64: return "64x64";
    case TileConfig::k128x64: return "128x64";
    case TileConfig::k128x128: return "128x128";
  }
  return "?";
}

py::dict plan(int64_t m, int64_t n, int64_t k, bool trans_a, bool trans_b, int sms,
              int smem_per_sm, int smem_per_block) {
  ASTRAI_CHECK(m > 0 && n > 0 && k > 0 && m <= kIntMax && n <= kIntMax && k <= kIntMax,
               "m, n, k: expected positive int32 sizes, got ", m, ", ", n, ", ", k);
  ASTRAI_CHECK(sms > 0 && smem_per_sm > 0 && smem_per_block > 0, "sms, smem_per_sm, smem_per_block: must be positive");
  GemmArgs args{};
  args.m = static_cast<int>(m), args.n = static_cast<int>(n), args.k = static_cast<int>(k);
  args.trans_a = trans_a, args.trans_b = trans_b;
  args.lda = args.ldb = args.ldc = 16;
  const CanonicalGemm g = canonicalize_gemm(args);
  const GemmPlan p = plan_gemm(g.problem, DeviceLimits{sms, smem_per_sm, smem_per_block});
  const TileShape s = tile_shape(p.tile);
  static const char* layout_names[] = {"CC", "CX", "XX"};
  py::dict d;
  d["tile"] = tile_name(p.tile);
  d["block_m"] = s.bm;
  d["block_n"] = s.bn;
  d["swap_ab"] = g.params.swap_ab != 0;
  d["layouts"] = layout_names[static_cast<int>(g.layouts)];
  d["tiles_m"] = p.tiles_m;
  d["tiles_n"] = p.tiles_n;
  d["grid"] = p.grid;
  d["threads"] = p.threads;
  d["smem_bytes"] = p.smem_bytes;
  d["group_m"] = p.group_m;
  d["ctas_per_sm"] = p.ctas_per_sm;
  return d;
}

}  // namespace
}  // namespace astrai::fp8

PYBIND11_MODULE(_fp8_ops, m) {
  namespace py = pybind11;
  astrai::bind::init_module(m);
  m.doc() = "AstrAI FP8 quantize + GEMM (ABI 1): torch-free, pointers + shapes + strides, " ASTRAI_FP8_MIN_SM_TEXT "+.";
  m.def("quantize", &astrai::fp8::quantize, py::arg("x"), py::arg("scale"), py::arg("q"),
        py::arg("q_t"), py::arg("amax"), py::arg("out_layout"), py::arg("stream"),
        "q = saturate(x * scale) (fp8, format = q's dtype), q_t = q^T, amax = max|x|.\n"
        "x [M, K] f32/f16/bf16 with a contiguous last dim; scale, amax float32 scalars;\n"
        "out_layout 0: q only, 1: q_t only, 2: both (the other output is an empty tensor).");
  m.def("quantize_rows", &astrai::fp8::quantize_rows, py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("stream"),
        "Per-token e4m3: scale[r] = max|x[r, :]| * float32(1 / 448) (1 where that is not > 0), q = x / scale[r],\n"
        "IEEE rounding (torch's bytes). x [M, K] bf16 / f16 with 16-byte aligned rows, K a multiple of 8; q [M, K]\n"
        "e4m3 with 8-byte aligned rows; scale float32 [M] contiguous.");
  m.def("gemm", &astrai::fp8::gemm_op, py::arg("a"), py::arg("b"), py::arg("scale"), py::arg("bias"),
        py::arg("out"), py::arg("trans_a"), py::arg("trans_b"), py::arg("stream"),
        py::arg("mainloop") = "auto",
        "out[M, N] (bf16) = scale * op(a) @ op(b) + bias. a is [M, K] ([K, M] if trans_a),\n"
        "b is [K, N] ([N, K] if trans_b), fp8 (e4m3/e5m2, may differ), unit last stride;\n"
        "scale a float32 scalar (the combined dequant scale); bias bf16 [N] or None.\n"
        "mainloop: 'auto' (the sm_90a wgmma kernel where it applies, else mma.sync) or\n"
        "'mma_sync' (always the mma.sync kernel: native on " ASTRAI_FP8_MMA_SYNC_NATIVE_SM_TEXT
        ", emulated elsewhere).");
  m.def("gemm_rowwise", &astrai::fp8::gemm_rowwise, py::arg("a"), py::arg("b"), py::arg("a_scale"),
        py::arg("b_scale"), py::arg("out"), py::arg("stream"),
        "out[M, N] (bf16) = (a_scale[m] * b_scale[n]) * a @ b^T: a [M, K] and b [N, K] fp8 (e4m3/e5m2) with unit\n"
        "last stride, a_scale float32 [M], b_scale float32 [N] contiguous. The sm_90a wgmma kernel only (promoted\n"
        "sums; split-K over a cluster where N leaves SMs idle): elsewhere it raises with the reason.");
  m.def("scale_update", &astrai::fp8::scale_update, py::arg("hist"), py::arg("pending"),
        py::arg("prev_scale"), py::arg("scale"), py::arg("scale_inv"), py::arg("factor"),
        py::arg("most_recent"), py::arg("stream"),
        "Delayed-scaling step end, per row r of hist [..., L] (float32, contiguous):\n"
        "hist[r] <- [pending[r], hist[r][:-1]] in place; amax = pending[r] if most_recent\n"
        "else max(new hist[r]) (NaN propagates); s = amax * float32(factor) if amax is finite\n"
        "and > 0 else prev_scale[r]; scale[r] = s, scale_inv[r] = 1/s; pending[r] = 0.\n"
        "pending, prev_scale, scale, scale_inv: float32 contiguous, one element per row;\n"
        "prev_scale may alias scale. Bit-identical to the same torch ops on CUDA.");
  m.def("weight_gemm", &astrai::fp8::weight_gemm, py::arg("x"), py::arg("w"), py::arg("w_scale"), py::arg("y"),
        py::arg("ws"), py::arg("k_per_split"), py::arg("stream"),
        "y [M, N] = x [M, K] (w [N, K] * w_scale [N])^T for M <= 64: x, y bf16 / f16, w fp8 (e4m3 / e5m2),\n"
        "w_scale float32; K a multiple of 256, rows 16-byte aligned. k_per_split < K splits K over\n"
        "blocks adding into ws (float32 [M, N], zero on entry and left zero); else ws may be None.");
  m.def("weight_gemm_plan", &astrai::fp8::weight_gemm_plan, py::arg("n"), py::arg("k"), py::arg("sms"),
        "k_per_split of the weight GEMM for N output channels on sms SMs (pure host function).");
  m.def("plan", &astrai::fp8::plan, py::arg("m"), py::arg("n"), py::arg("k"), py::arg("trans_a"),
        py::arg("trans_b"), py::arg("sms"), py::arg("smem_per_sm"), py::arg("smem_per_block"),
        "The launch plan fp8_gemm would use (pure host function, no GPU needed).");
  astrai::fp8::sm90::bind_planning(
      m.def_submodule("sm90", "The Hopper (sm_90a) GEMM's planner, csrc/gemm/sm90/planning.h (no GPU needed)."));
}
