"""fp8_autocast linear vs the bf16 linear, forward and forward+backward, plus a loss curve.

    python bench/bench_fp8_linear.py [--json out.json] [--quick] [--device cpu] [--ms 1024 4096]

Per shape (M tokens x N x K weight): milliseconds and TFLOP/s of
  bf16        F.linear in bf16 (cuBLAS)
  fp8         the same nn.Linear inside fp8_autocast(DelayedScaling) - everything it
              does per call: quantize x and W, the FP8 GEMM, the bookkeeping (inference
              with cache_weights=True: the FP8 copy of the weight is reused while the
              weight is unchanged, in CUDA graphs as well)
  gemm        the FP8 GEMM alone as the policy runs it (the ceiling for the fp8 column)
  floor       (training step, CUDA) a Python autograd.Function running only the step's three
              FP8 GEMMs on operands quantized beforehand: the host-cost floor of any FP8
              linear written in Python (where it loses to bf16, so must any)
and the share of the fp8 time spent outside the GEMM. Times are medians (``astrai.timing``;
a line under the tables names each timer and its rounds, the JSON keeps each figure's
timing with its IQR) over rotating inputs: single eager calls, ``--reps`` rounds. Where the
time goes: ``host`` is the thread CPU time to issue one call (nothing waited for), ``piped``
the time per call of 3 rounds of 20 back-to-back calls (the GPU
work when the host keeps ahead, the host time when it does not), and ``graph`` the time per call
with 10 calls captured into one CUDA graph and replayed (the GPU work alone, no host cost;
what a user at small M running CUDA graphs gets; the FP8 state advances on every replay,
its updates being captured in place). A function that cannot be captured gets ``None`` and the reason under
``<name>_graph_error``. The FP8 backend the policy chose, with its reason, is printed and
stored. Last, a 2-layer MLP trained 200 steps in bf16 and under fp8_autocast:
the loss curves (20-step means) side by side.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from astrai import timing
from astrai.extension.backend import fp8 as backend
from astrai.extension.device import probe_device
from astrai.extension.fp8 import DelayedScaling, fp8_autocast
from astrai.extension.runtime import current_runtime

SHAPES_NK = [(8192, 8192), (28672, 8192), (8192, 28672)]
MS = [1024, 4096, 8192]


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def bench_shape(m: int, n: int, k: int, device: str, reps: int) -> dict:
    dtype = torch.bfloat16
    lin = torch.nn.Linear(k, n, bias=True, device=device, dtype=dtype)
    # the training steps' own copy: an optimizer changes the weight every step, so its FP8
    # copy is made every step (never the one the inference calls cached)
    lin_train = torch.nn.Linear(k, n, bias=True, device=device, dtype=dtype)
    lin_train.load_state_dict(lin.state_dict())
    xs = [torch.randn(m, k, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    gy = torch.randn(m, n, device=device, dtype=dtype)
    recipe = DelayedScaling(amax_history_len=16)
    it = iter(range(10**9))

    def x():
        return xs[next(it) % len(xs)]

    def bf16_fwd():
        with torch.no_grad():
            F.linear(x(), lin.weight, lin.bias)

    def fp8_fwd():  # cache_weights=True: the FP8 weight is reused, inside CUDA graphs too
        with torch.no_grad(), fp8_autocast(recipe=recipe, cache_weights=True):
            lin(x())

    def bf16_step():
        F.linear(x(), lin_train.weight, lin_train.bias).backward(gy)

    def fp8_step():
        with fp8_autocast(recipe=recipe):
            y = lin_train(x())
        y.backward(gy)

    a8 = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    w8 = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)

    def gemm_only():
        backend.gemm(a8, w8.t(), one, lin.bias)

    floor = _floor_function(m, n, k, device)

    def floor_step():
        floor.apply(x(), lin_train.weight, lin_train.bias).backward(gy)

    res = {"m": m, "n": n, "k": k, "timings": {}}
    fwd_flop, step_flop = 2.0 * m * n * k, 6.0 * m * n * k
    for name, fn, flop in [("bf16_fwd", bf16_fwd, fwd_flop), ("fp8_fwd", fp8_fwd, fwd_flop),
                           ("gemm_fwd", gemm_only, fwd_flop), ("bf16_step", bf16_step, step_flop),
                           ("fp8_step", fp8_step, step_flop),
                           ("floor_step", floor_step if floor else None, step_flop)]:
        if fn is None:
            continue
        timed = {"": timing.eager(fn, calls=1, rounds=reps),
                 # the CPU time to issue one call, the GPU idle before it
                 "_host": timing.host(fn, calls=1, rounds=reps, setup=lambda: _sync(device)),
                 "_piped": timing.eager(fn, calls=20, rounds=3)}
        if device != "cpu":
            try:
                timed["_graph"] = timing.graph(fn)
            except Exception as exc:  # noqa: BLE001 - reported, not hidden
                res[name + "_graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
                torch.cuda.synchronize()
        for kind, t in timed.items():
            res[f"{name}{kind}_ms"] = t.ms
            res["timings"][f"{name}{kind}_ms"] = t
        res.setdefault(name + "_graph_ms", None)
        res[name + "_tflops"] = flop / res[name + "_ms"] / 1e9
        for p in lin_train.parameters():
            p.grad = None
        for t in xs:
            t.grad = None
    res["fwd_speedup"] = res["bf16_fwd_ms"] / res["fp8_fwd_ms"]
    if floor:
        res["floor_step_speedup"] = res["bf16_step_ms"] / res["floor_step_ms"]
    res["step_speedup"] = res["bf16_step_ms"] / res["fp8_step_ms"]
    res["fp8_fwd_outside_gemm"] = 1 - res["gemm_fwd_ms"] / res["fp8_fwd_ms"]
    return res


def _floor_function(m: int, n: int, k: int, device: str):
    """The host-cost floor of any FP8 linear written as a Python ``autograd.Function``: one
    whose forward and backward run only the step's three cuBLASLt FP8 GEMMs (and the bias
    gradient) on operands quantized beforehand, no quantize, no scaling. Where even this
    loses to the bf16 step, the step is bound by the host path, not by the FP8 layer's
    own work. None off CUDA."""
    if device == "cpu":
        return None
    a8 = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    at8 = a8.t().contiguous()
    w8 = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
    wt8 = w8.t().contiguous()
    g8 = torch.randn(m, n, device=device).to(torch.float8_e5m2)
    gt8 = g8.t().contiguous()
    one = torch.ones((), device=device)
    bf16 = torch.bfloat16

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias):
            return torch._scaled_mm(a8, w8.t(), one, one, bias=bias, out_dtype=bf16)

        @staticmethod
        def backward(ctx, grad):
            dx = torch._scaled_mm(g8, wt8.t(), one, one, out_dtype=bf16)
            dw = torch._scaled_mm(gt8, at8.t(), one, one, out_dtype=bf16)
            return dx, dw, grad.sum(0, dtype=torch.float32).to(bf16)

    return Floor


def loss_curves(device: str, steps: int, d: int) -> dict:
    def train(enabled: bool) -> list[float]:
        torch.manual_seed(0)
        teacher = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh(),
                                      torch.nn.Linear(d, d // 4)).to(device)
        model = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                    torch.nn.Linear(4 * d, d // 4)).to(device, torch.bfloat16)
        opt = torch.optim.Adam(model.parameters(), lr=3e-4)
        gen = torch.Generator(device=device).manual_seed(1)
        losses = []
        for _ in range(steps):
            x = torch.randn(1024, d, device=device, generator=gen)
            with torch.no_grad():
                target = teacher(x)
            with fp8_autocast(enabled=enabled, recipe=DelayedScaling(amax_history_len=16)):
                loss = F.mse_loss(model(x.to(torch.bfloat16)).float(), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return torch.stack(losses).view(-1, 20).mean(1).tolist()

    bf16, fp8 = train(False), train(True)
    worst = max(abs(a - b) / b for a, b in zip(fp8, bf16))
    return {"steps": steps, "width": d, "bf16_means": bf16, "fp8_means": fp8, "max_rel_diff": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ms", type=int, nargs="+", default=MS, help="token counts M to run")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device = args.device
    quick = args.quick or device == "cpu"
    shapes = [(m, n, k) for m in args.ms for n, k in SHAPES_NK]
    if quick:
        shapes = [(128, 256, 512), (256, 512, 256)] if device == "cpu" else shapes[:2]
    info = probe_device(device)
    rows = [bench_shape(m, n, k, device, reps=3 if quick else args.reps) for m, n, k in shapes]
    # every decision the runs made (the GEMM's per shape class, when a measured table decides)
    decisions = [str(d) for d in current_runtime().explain() if d.op.startswith("fp8")]
    print("\n".join(decisions))
    curves = loss_curves(device, 40, 64) if device == "cpu" else loss_curves(device, 200, 1024)

    print(f"\n{'M':>6} {'N':>6} {'K':>6} | {'bf16 fwd':>9} {'fp8 fwd':>9} {'gemm':>9} {'x':>5} "
          f"{'outside':>7} | {'bf16 step':>9} {'fp8 step':>9} {'x':>5}   (TFLOP/s; x = speedup)")
    for r in rows:
        print(f"{r['m']:>6} {r['n']:>6} {r['k']:>6} | {r['bf16_fwd_tflops']:9.1f} {r['fp8_fwd_tflops']:9.1f} "
              f"{r['gemm_fwd_tflops']:9.1f} {r['fwd_speedup']:5.2f} {r['fp8_fwd_outside_gemm']:7.0%} | "
              f"{r['bf16_step_tflops']:9.1f} {r['fp8_step_tflops']:9.1f} {r['step_speedup']:5.2f}")
    print(f"\n{'M':>6} {'N':>6} {'K':>6} | host ms per call: {'bf16 fwd':>8} {'fp8 fwd':>8} {'gemm':>8} "
          f"{'bf16 st':>8} {'fp8 st':>8} | piped ms: {'bf16 fwd':>8} {'fp8 fwd':>8} {'gemm':>8} "
          f"{'bf16 st':>8} {'fp8 st':>8}")
    names = ("bf16_fwd", "fp8_fwd", "gemm_fwd", "bf16_step", "fp8_step")
    for r in rows:
        print(f"{r['m']:>6} {r['n']:>6} {r['k']:>6} | {'':>17}"
              + " ".join(f"{r[n + '_host_ms']:8.3f}" for n in names) + f" | {'':>9}"
              + " ".join(f"{r[n + '_piped_ms']:8.3f}" for n in names))
    print(f"\n{'M':>6} {'N':>6} {'K':>6} | CUDA graph ms per call: {'bf16 fwd':>8} {'fp8 fwd':>8} "
          f"{'x':>5} {'bf16 st':>8} {'fp8 st':>8} {'x':>5}")

    def graph(r, name):
        return r[name + "_graph_ms"]

    for r in rows:
        cells = []
        for a, b in (("bf16_fwd", "fp8_fwd"), ("bf16_step", "fp8_step")):
            ga, gb = graph(r, a), graph(r, b)
            cells += ["n/a" if ga is None else f"{ga:8.3f}", "n/a" if gb is None else f"{gb:8.3f}",
                      "" if ga is None or gb is None else f"{ga / gb:5.2f}"]
        print(f"{r['m']:>6} {r['n']:>6} {r['k']:>6} | {'':>22}" + " ".join(f"{c:>8}" for c in cells))
        for name in names:
            if name + "_graph_error" in r:
                print(f"    {name} not captured: {r[name + '_graph_error']}")
    if any("floor_step_ms" in r for r in rows):
        print(f"\n{'M':>6} {'N':>6} {'K':>6} | eager step ms: {'bf16':>8} {'fp8':>8} {'x':>5} "
              f"{'floor':>8} {'x':>5}   (floor: a Python autograd.Function with the three FP8 GEMMs "
              "alone)")
        for r in rows:
            print(f"{r['m']:>6} {r['n']:>6} {r['k']:>6} | {'':>14}{r['bf16_step_ms']:8.3f} "
                  f"{r['fp8_step_ms']:8.3f} {r['step_speedup']:5.2f} {r['floor_step_ms']:8.3f} "
                  f"{r['floor_step_speedup']:5.2f}   host ms: fp8 {r['fp8_step_host_ms']:.3f}, "
                  f"floor {r['floor_step_host_ms']:.3f}, bf16 {r['bf16_step_host_ms']:.3f}")
    print("\nloss (20-step means) bf16:", " ".join(f"{v:.4f}" for v in curves["bf16_means"]))
    print("loss (20-step means) fp8: ", " ".join(f"{v:.4f}" for v in curves["fp8_means"]))
    print(f"max relative difference: {curves['max_rel_diff']:.3f}")
    print(timing.legend(t for r in rows for t in r["timings"].values()))
    if args.json:
        meta = {"device": info.describe(), "torch": torch.__version__, "decisions": decisions}
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "shapes": rows, "loss": curves}, fh, indent=1, default=timing.jsonable)


if __name__ == "__main__":
    main()
