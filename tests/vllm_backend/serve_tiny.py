"""Serve a tiny local model through ``vllm.LLM`` and write its greedy tokens as JSON (run as a
script: vLLM spawns processes). ``python serve_tiny.py MODEL_DIR DTYPE OUT.json``; with
``ASTRAI_VLLM_REPLACE_CPU_ATTN=1`` the plugin serves the attention, and the JSON also counts
the calls AstrAI's backend ran."""

from __future__ import annotations

import json
import sys

# prompts of 1 to 150 tokens: single and many pages; the 150-token ones prefill in chunks
PROMPTS = [[1, 17, 300, 42, 7], [1], [1, *range(3, 150)], [1, *range(400, 470)], [1, *range(200, 340, 2)]]


def main(model_dir: str, dtype: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    from astrai.integrations.vllm import impl

    calls = {"forward": 0}
    forward = impl.AstraiAttentionImpl.forward

    def counted(self, *args, **kwargs):
        calls["forward"] += 1
        return forward(self, *args, **kwargs)

    impl.AstraiAttentionImpl.forward = counted  # in-process engine: this process runs the layers
    llm = LLM(model=model_dir, dtype=dtype, skip_tokenizer_init=True, max_model_len=512, seed=0,
              max_num_batched_tokens=64, enable_chunked_prefill=True, max_num_seqs=4,
              distributed_executor_backend="uni", enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    with open(out_path, "w") as f:
        json.dump({"tokens": tokens, "astrai_forward_calls": calls["forward"]}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
