"""``ops.attention.attn_paged_decode`` in eager mode: checked once per kind of call, a repeated
call only launches, passing the compiled entry point what the checked op passes it; a call
that differs in anything the checks read is checked again, before any launch. On the CPU,
with a fake compiled module on an H200."""

from __future__ import annotations

import weakref

import pytest
import torch
from fakes import H200, FakeEntryPoint, entry_points, fake_module, manifest

from astrai.extension.abi import tensor_arg
from astrai.extension.ops import _plugin
from astrai.extension.ops import attention as attn_ops
from astrai.extension.ops import decode_splits
from astrai.extension.ops.page_table import PageTableError
from astrai.extension.registry import PluginRejectedWarning, Registry
from astrai.extension.runtime import Runtime, use_runtime

B, HQ, HKV, D, PAGE, PAGES = 2, 8, 2, 64, 16, 10
OPS = {"attn_paged_decode": {"module": "fake_attention_module", "abi": 1, "dtypes": ["bfloat16"],
                             "head_dims": [64], "min_sm": 80}}


class Recorder:
    """The compiled module: records each launch's arguments, plans ``splits`` splits."""

    def __init__(self, splits=3):
        self.splits, self.launches, self.plans = splits, [], []

    def attn_paged_decode(self, *args, **kwargs):
        self.launches.append((args, kwargs))

    def decode_plan(self, *args, **kwargs):
        self.plans.append(args)
        return self.splits


@pytest.fixture
def module(monkeypatch):
    """CPU tensors take the op's CUDA path: an H200 current as device 0, the recorder as its module."""
    recorder = Recorder()
    monkeypatch.setattr(_plugin, "probe_device", lambda device=None: H200)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type == "cpu"))
    monkeypatch.setattr(attn_ops, "current_device", lambda: 0)
    monkeypatch.setattr(attn_ops, "current_stream", lambda index: 0)
    monkeypatch.setattr(attn_ops, "launch", lambda device, fn, *args, **kwargs: fn(*args, 0, **kwargs))
    monkeypatch.setattr(decode_splits, "_num_sms", lambda device: 132)
    monkeypatch.setattr(attn_ops, "_EAGER_DECODES", {})
    registry = Registry(entry_points(FakeEntryPoint("attention", manifest("astrai-attention", ops=OPS))),
                        importer=lambda name: fake_module(name, attn_paged_decode=recorder.attn_paged_decode,
                                                          decode_plan=recorder.decode_plan))
    with use_runtime(Runtime(registry)):
        yield recorder


def decode_args(seed=0, **override):
    g = torch.Generator().manual_seed(seed)
    args = dict(q=torch.randn(B, 1, HQ, D, generator=g).bfloat16(),
                k_cache=torch.randn(PAGES, PAGE, HKV, D, generator=g).bfloat16(),
                v_cache=torch.randn(PAGES, PAGE, HKV, D, generator=g).bfloat16(),
                kv_indptr=torch.tensor([0, 2, 3], dtype=torch.int32),
                kv_indices=torch.tensor([4, 1, 7], dtype=torch.int32),
                kv_lens=torch.tensor([20, 5], dtype=torch.int32))
    args.update(override)
    return args


def op_launch(module, args, **kwargs):
    """What the checked op itself (no memo) passes the entry point."""
    out = attn_ops._attn_paged_decode_op(*args.values(), kwargs.get("num_splits", 0), kwargs.get("scale"),
                                         kwargs.get("logits_soft_cap"), kwargs.get("window_left", -1),
                                         kwargs.get("sinks"), kwargs.get("alibi_slopes"), kwargs.get("k_scale"),
                                         kwargs.get("v_scale"))
    return out, module.launches[-1]


def without_new_buffers(launch):
    """A launch's arguments without the pointers of what each call allocates (out, workspaces)."""
    args, kwargs = launch
    fresh = lambda a: None if a is None else a[1:]  # noqa: E731
    return (*args[:3], fresh(args[3]), *args[4:8], fresh(args[8]), fresh(args[9]), *args[10:]), kwargs


@pytest.mark.parametrize("num_splits", [0, 4, 1])
def test_a_repeated_call_launches_what_the_checked_op_launches(module, num_splits):
    first, second = decode_args(0), decode_args(1)
    out1 = attn_ops.attn_paged_decode(*first.values(), num_splits=num_splits)
    out2 = attn_ops.attn_paged_decode(*second.values(), num_splits=num_splits)
    assert len(attn_ops._EAGER_DECODES) == 1 and len(module.launches) == 2
    assert len(module.plans) == (1 if num_splits == 0 else 0)  # planned once for the kind of call
    for (args, launch), out in zip([(first, module.launches[0]), (second, module.launches[1])], [out1, out2]):
        by_op_out, by_op = op_launch(module, args, num_splits=num_splits)
        assert without_new_buffers(launch) == without_new_buffers(by_op)
        assert launch[0][0] == tensor_arg(args["q"]) and launch[0][3] == tensor_arg(out)
        assert out.shape == by_op_out.shape and out.dtype == by_op_out.dtype and out.is_contiguous()
    assert module.launches[0][0][3][0] != module.launches[1][0][3][0]  # a new output per call
    splits = module.launches[0][0][7]
    assert splits == {0: 3, 4: 4, 1: 1}[num_splits]
    assert (module.launches[0][0][8] is None) == (splits == 1)


def test_variants_and_fp8_scales_reach_the_launch_as_the_op_passes_them(module):
    g = torch.Generator().manual_seed(2)
    sinks = torch.randn(HQ, generator=g)
    scales = dict(k_scale=torch.rand(1, generator=g), v_scale=torch.rand(HKV, generator=g))
    for seed in (0, 1):
        args = decode_args(seed)
        attn_ops.attn_paged_decode(*args.values(), scale=0.5, logits_soft_cap=30.0, window_left=7, sinks=sinks,
                                   **scales)
        launch = module.launches[-1]
        assert launch[1] == {"variant": (0.5, 30.0, 7, tensor_arg(sinks)),
                             "kv_scales": (tensor_arg(scales["k_scale"]), tensor_arg(scales["v_scale"]))}
        _, by_op = op_launch(module, args, scale=0.5, logits_soft_cap=30.0, window_left=7, sinks=sinks, **scales)
        assert without_new_buffers(launch) == without_new_buffers(by_op)
    slopes = torch.rand(HQ, generator=g)  # the fifth item, and a key of its own
    attn_ops.attn_paged_decode(*decode_args().values(), alibi_slopes=slopes, **scales)
    assert module.launches[-1][1]["variant"] == (0.0, 0.0, -1, None, tensor_arg(slopes))
    attn_ops.attn_paged_decode(*decode_args().values(), **scales)
    assert module.launches[-1][1] == {"kv_scales": (tensor_arg(scales["k_scale"]), tensor_arg(scales["v_scale"]))}
    with pytest.raises(ValueError, match="^k_scale: an FP8 cache needs both"):
        attn_ops.attn_paged_decode(*decode_args().values(), k_scale=scales["k_scale"])


@pytest.mark.parametrize("override, error, match", [
    (dict(kv_lens=torch.tensor([20, 5])), TypeError, "kv_lens must be int32, got torch.int64"),
    (dict(kv_indptr=torch.tensor([0, 2], dtype=torch.int32)), ValueError, r"kv_indptr must have shape \[batch \+ 1\]"),
    (dict(kv_indices=torch.zeros(3, 1, dtype=torch.int32)), ValueError, "kv_indices must have shape"),
    (dict(v_cache=torch.zeros(PAGES, PAGE, HKV, D, dtype=torch.bfloat16, device="meta")), ValueError,
     "v_cache is on meta but q is on cpu"),
    (dict(k_cache=torch.zeros(PAGES, PAGE * HKV * D, dtype=torch.bfloat16)), ValueError,
     r"k_cache must be \[num_pages, page_size, kv_heads, head_dim\]"),
    (dict(q=torch.zeros(B, 1, HQ, D)), TypeError, "q: "),
    (dict(kv_lens=[20, 5]), TypeError, "kv_lens must be a torch.Tensor, got list"),
])
def test_a_call_that_differs_is_checked_again_before_any_launch(module, override, error, match):
    attn_ops.attn_paged_decode(*decode_args().values())
    with pytest.raises(error, match=f"^attn_paged_decode: {match}"):
        attn_ops.attn_paged_decode(*decode_args(1, **override).values())
    assert len(module.launches) == 1


def test_a_growing_page_table_keeps_its_kind_and_plans_its_splits_per_length(module):
    attn_ops.attn_paged_decode(*decode_args().values())
    longer = decode_args(1, kv_indptr=torch.tensor([0, 3, 4], dtype=torch.int32),
                         kv_indices=torch.tensor([4, 1, 2, 7], dtype=torch.int32),
                         kv_lens=torch.tensor([40, 5], dtype=torch.int32))
    attn_ops.attn_paged_decode(*longer.values())
    attn_ops.attn_paged_decode(*longer.values())
    assert len(attn_ops._EAGER_DECODES) == 1
    assert [plan[4] for plan in module.plans] == [24, 32]  # pages * page / batch, once per length
    assert module.launches[-1][0][5] == tensor_arg(longer["kv_indices"])
    _, by_op = op_launch(module, longer)
    assert without_new_buffers(module.launches[-2]) == without_new_buffers(by_op)


def test_rows_the_kernels_cannot_stream_are_copied_as_the_op_copies_them(module):
    args = decode_args()
    attn_ops.attn_paged_decode(*args.values())
    flat = torch.randn(B * HQ * D + 8).bfloat16()
    shifted = flat[1:1 + B * HQ * D].view(B, 1, HQ, D)  # q's layout, 2 bytes off 16-byte alignment
    attn_ops.attn_paged_decode(*{**args, "q": shifted}.values())
    launched = module.launches[-1][0][0]
    assert launched[0] != shifted.data_ptr() and launched[0] % 16 == 0 and launched[1:] == tensor_arg(args["q"])[1:]


def test_an_op_marked_unusable_raises_the_install_error(module):
    attn_ops.attn_paged_decode(*decode_args().values())
    registry = _plugin.current_runtime().registry
    with pytest.warns(PluginRejectedWarning):
        registry.mark_unusable("attn_paged_decode", H200, "no kernel image for sm_90")
    with pytest.raises(RuntimeError, match="needs the astrai-attention plugin, which is not usable here"):
        attn_ops.attn_paged_decode(*decode_args(1).values())
    assert len(module.launches) == 1


def test_debug_mode_checks_the_page_table_values_on_every_call(module, monkeypatch):
    attn_ops.attn_paged_decode(*decode_args().values())
    monkeypatch.setenv("ASTRAI_DEBUG", "1")
    bad = decode_args(1, kv_indices=torch.tensor([4, 1, 1000], dtype=torch.int32))
    with pytest.raises(PageTableError, match="request 1: kv_indices holds page id 1000"):
        attn_ops.attn_paged_decode(*bad.values())
    assert len(module.launches) == 1


def test_every_buffer_of_a_repeated_call_is_alive_at_its_launch(module, monkeypatch):
    """out and both split workspaces are still referenced when the entry point runs: memory freed
    before the launch goes to the next allocation (the other workspace, or a captured graph's next
    op), and the kernel would write partials the combine reads as something else."""
    made = []

    def tracking_allocator(device):
        def alloc(shape, strides, dtype):
            t = torch.empty_strided(shape, strides, dtype=dtype, device=device)
            made.append(weakref.ref(t))
            return t
        return alloc

    alive_at_launch = []
    record = module.attn_paged_decode

    def checking(*args, **kwargs):
        alive_at_launch.append([r() is not None for r in made])
        record(*args, **kwargs)

    monkeypatch.setattr(attn_ops, "empty_allocator", tracking_allocator)
    monkeypatch.setattr(module, "attn_paged_decode", checking)
    for seed in (0, 1):
        attn_ops.attn_paged_decode(*decode_args(seed).values(), num_splits=4)
    assert len(alive_at_launch) == 2 and alive_at_launch[-1][-3:] == [True, True, True]
    assert module.launches[-1][0][7] == 4 and module.launches[-1][0][8] is not None
