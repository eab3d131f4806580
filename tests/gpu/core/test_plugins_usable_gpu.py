"""On a CUDA machine every op of the three plugins is served by its kernel: a plugin that
is missing or rejected fails here with the reason ``astrai doctor`` gives, instead of the
other GPU tests passing on a fallback or skipping."""

from __future__ import annotations

import pytest
import torch

from astrai.extension.ops._plugin import PLUGIN_OF_OP

pytestmark = pytest.mark.gpu

FP8_OPS = {op for op, plugin in PLUGIN_OF_OP.items() if plugin == "astrai-fp8"}


@pytest.mark.parametrize("op", sorted(PLUGIN_OF_OP))
def test_every_plugin_op_is_usable_here(require_plugin, op):
    if op in FP8_OPS and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the astrai-fp8 kernels need sm_89+")
    assert require_plugin(op).plugin.name == PLUGIN_OF_OP[op]
