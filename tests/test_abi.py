"""The call convention's helpers against what torch itself does."""

import itertools

import torch

from astrai.extension.abi import contiguous_strides, tensor_arg


def test_contiguous_strides_are_those_of_a_new_tensor():
    for shape in itertools.chain(itertools.product([0, 1, 2, 5], repeat=4), [(), (7,), (3, 1, 32, 128)]):
        assert contiguous_strides(shape) == torch.empty(shape).stride(), shape


def test_tensor_arg_of_a_view():
    x = torch.randn(4, 6, 8)[1:, ::2].transpose(0, 1)
    assert tensor_arg(x) == (x.data_ptr(), (3, 3, 8), (16, 48, 1), 0)
    assert tensor_arg(None) is None
