"""How an ops wrapper reaches its compiled module: through the registry, or a clear error."""

from __future__ import annotations

from types import ModuleType

import torch

from ..device import probe_device
from ..install import PLUGIN_EXTRAS, pip_command
from ..runtime import current_runtime

# Which of the project's plugins provides each op (for the error message only:
# any plugin in the entry-point group may provide an op).
PLUGIN_OF_OP = {
    "attn_decode": "astrai-attention",
    "attn_prefill": "astrai-attention",
    "attn_paged_decode": "astrai-attention",
    "attn_paged_prefill": "astrai-attention",
    "rotary_emb": "astrai-rotary",
    "fp8_quantize": "astrai-fp8",
    "fp8_gemm": "astrai-fp8",
}


def require(op: str, device: torch.device | str | None = None) -> ModuleType:
    """The compiled module serving ``op`` on ``device``; ``RuntimeError`` naming the
    plugin, the reason and the install command when there is none."""
    info = probe_device(device)
    registry = current_runtime().registry
    status = registry.op_status(op, info)
    if status.usable:
        return registry.load(op, info)
    plugin = PLUGIN_OF_OP.get(op, "a plugin providing it")
    hint = pip_command(PLUGIN_EXTRAS[plugin], info.driver_cuda) if plugin in PLUGIN_EXTRAS else ""
    raise RuntimeError(f"astrai.extension.ops.{op} needs the {plugin} plugin, which is not usable "
                       f"here ({status.reason}). Install it with: {hint}".rstrip())
