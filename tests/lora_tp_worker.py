"""Run by tests/test_lora.py in a subprocess with 8 virtual CPU devices: greedy generations of prompts
over LoRA adapters at each tensor-parallel size, and the shards of the adapters' stacks (JSON).
Usage: lora_tp_worker.py MODEL_DIR SIZES ADAPTER_DIR..."""

from __future__ import annotations

import json
import sys

from jaxserve import LLM, LoRARequest, SamplingParams

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, enable_lora=True, max_loras=2)


def run(model_dir: str, sizes: list[int], adapters: list[str]) -> dict:
    requests = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
    prompts = ["tensor parallel", "adapters split", "like their layers", "base"]
    loras = [*requests, None][:len(prompts)]
    results = {}
    for tp in sizes:
        llm = LLM(model_dir, tensor_parallel_size=tp, **ENGINE)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), lora_request=loras,
                               use_tqdm=False)
        stacks = llm.engine.runner.adapters.stacks
        results[tp] = {"tokens": [o.outputs[0].token_ids for o in outputs],
                       "stacks": {path: [list(x.sharding.shard_shape(x.shape)) for x in stacks[path]]
                                  for path in ("layers.0.self_attn.q_proj", "layers.0.self_attn.o_proj")}}
    return results


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], [int(s) for s in sys.argv[2].split(",")], sys.argv[3:])))
