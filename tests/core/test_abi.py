"""The call convention's helpers against what torch itself does."""

import itertools

import torch

from astrai.extension import abi
from astrai.extension.abi import contiguous_strides, tensor_arg


def test_contiguous_strides_are_those_of_a_new_tensor():
    for shape in itertools.chain(itertools.product([0, 1, 2, 5], repeat=4), [(), (7,), (3, 1, 32, 128)]):
        assert contiguous_strides(shape) == torch.empty(shape).stride(), shape


def test_tensor_arg_of_a_view():
    x = torch.randn(4, 6, 8)[1:, ::2].transpose(0, 1)
    assert tensor_arg(x) == (x.data_ptr(), (3, 3, 8), (16, 48, 1), 0)
    assert tensor_arg(None) is None


def test_the_launchers_allocator_returns_fresh_tensors_of_the_layout_asked():
    alloc = abi.empty_allocator(torch.device("cpu"))
    for shape, strides, dtype in (((3, 1, 4, 8), (32, 32, 8, 1), torch.bfloat16), ((2, 5), (1, 2), torch.float32),
                                  ((7,), (1,), torch.float16)):
        a, b = alloc(shape, strides, dtype), alloc(shape, strides, dtype)
        for t in (a, b):
            assert (t.shape, t.stride(), t.dtype, t.device.type) == (shape, strides, dtype, "cpu")
            assert not t.requires_grad
        assert a.data_ptr() != b.data_ptr()  # each call a new output, never a shared buffer
        a.fill_(1.0)
        b.fill_(2.0)
        assert a.eq(1.0).all()


def test_the_allocator_falls_back_to_empty_strided_where_the_fast_entry_point_fails(monkeypatch):
    def broken(shape, strides, dtype):
        raise TypeError("another signature")

    monkeypatch.setattr(abi, "_FAST_EMPTY", {})
    monkeypatch.setattr(torch._C._dynamo.guards, "_empty_strided_cpu", broken, raising=False)
    alloc = abi.empty_allocator(torch.device("cpu"))
    assert alloc is not broken
    t = alloc((2, 3), (1, 2), torch.float16)
    assert (t.shape, t.stride(), t.dtype) == ((2, 3), (1, 2), torch.float16)
    monkeypatch.setattr(abi, "_FAST_EMPTY", {})
    monkeypatch.delattr(torch._C._dynamo.guards, "_empty_strided_cpu", raising=False)
    t = abi.empty_allocator(torch.device("cpu"))((4,), (1,), torch.float32)
    assert (t.shape, t.dtype) == ((4,), torch.float32)


def test_a_meta_device_gets_the_generic_allocator():
    t = abi.empty_allocator(torch.device("meta"))((2, 3), (3, 1), torch.bfloat16)
    assert (t.device.type, t.shape, t.stride(), t.dtype) == ("meta", (2, 3), (3, 1), torch.bfloat16)
