"""One rank of a transformers tensor-parallel forward with ``attn_implementation="astrai"``
(run by ``torchrun``; tests/serve/test_transformers_tp.py): loads MODEL_DIR with
``tp_plan="auto"`` on the CPU (gloo) and rank 0 saves the logits of a fixed batch to OUT.

    torchrun --nproc-per-node 2 transformers_tp_run.py MODEL_DIR OUT.pt
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def main(model_dir: str, out: str) -> None:
    from transformers import AutoModelForCausalLM

    from astrai.integrations.transformers import register

    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", attn_implementation=register(),
                                                 dtype=torch.float32)
    ids = torch.arange(3, 3 + 2 * 40).reshape(2, 40) % 290 + 1
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if dist.get_rank() == 0:
        torch.save(logits, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
