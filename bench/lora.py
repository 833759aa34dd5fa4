"""LoRA adapters: W2 with every request on a different adapter against the base model alone, in one run.

    python bench/lora.py [--runs 2] [--adapters 8] [--slots 4] [--rank 16] [--write]
    python bench/lora.py --products [--slots 4] [--rank 16]

Writes `--adapters` random rank-`--rank` adapters of every attention and MLP projection of the default
model (SmolLM2-135M-Instruct, Q4_1 GGUF) in PEFT's format, then starts `run_server.py` twice: without
LoRA, and with `--enable-lora --max-loras SLOTS` and the adapters as --lora-modules. Each is sent
bench/loadgen.py's W2 (32 concurrent streams, 128-token prompts, 128 new tokens, greedy, `ignore_eos`):
the base model by name on both, and on the second also with request i naming adapter i % adapters (so
adapters outnumber the slots and take turns). Reports output tokens/s and TTFT, and the ratios to the
base model on the server without LoRA. `--write` puts the table into bench/RESULTS.md between the lora
markers.

`--products` prints `bench/lora_products.py`'s table in the default model's shapes (the two forms of
the adapters' products against the base products alone, without a server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoints import DEFAULT_MODEL_NAME, builtin  # noqa: E402
from checkpoints.gguf import model_view  # noqa: E402
import lora_products  # noqa: E402
from common import free_port, machine_line, server, write_between  # noqa: E402
from loadgen import WORKLOADS, one, prompts  # noqa: E402
from peers import CACHE  # noqa: E402

MARKERS = ("<!-- lora:start -->", "<!-- lora:end -->")
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapters(config: dict, count: int, rank: int, out: Path) -> list[Path]:
    """`count` PEFT adapters of random A and B (scale 2: lora_alpha 2r) on every projection."""
    from safetensors.numpy import save_file

    d, inter, hd = config["hidden_size"], config["intermediate_size"], config["hidden_size"] // config[
        "num_attention_heads"]
    kv = config["num_key_value_heads"] * hd
    shapes = {"q_proj": (d, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, d),
              "gate_proj": (inter, d), "up_proj": (inter, d), "down_proj": (d, inter)}
    paths = []
    for i in range(count):
        rng, path = np.random.default_rng(i), out / f"adapter{i}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for name, (rows, cols) in shapes.items():
                prefix = f"base_model.model.model.layers.{layer}.{MODULES[name]}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.02, (rank, cols)).astype(np.float32)
                tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.02, (rows, rank)).astype(np.float32)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                              "target_modules": list(MODULES)}))
        paths.append(path)
    return paths


async def w2(url: str, models: list[str], offset: int) -> dict:
    """loadgen's W2, request i naming models[i % len(models)]."""
    spec = WORKLOADS["W2"]
    requests = prompts(spec["requests"], offset + spec["first"])
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=128)) as client:
        start = time.perf_counter()
        traces = await asyncio.gather(*(one(client, url, models[i % len(models)], p) for i, p in enumerate(requests)))
        elapsed = time.perf_counter() - start
    return dict(output_tok_s=sum(t.completion_tokens for t in traces) / elapsed,
                ttft_p50=np.percentile([t.ttft for t in traces], 50))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--products", action="store_true")
    args = parser.parse_args()
    if args.products:
        return print(lora_products.table(args.slots, args.rank, lora_products.DIMS["default"]))
    model = builtin.fetch(DEFAULT_MODEL_NAME)
    config = json.loads((model_view(model) / "config.json").read_text())
    adapters = write_adapters(config, args.adapters, args.rank, CACHE / "lora-adapters")
    names = [f"a{i}" for i in range(args.adapters)]
    base = [sys.executable, "run_server.py", "--model", str(model), "--served-model-name", "bench", "--max-model-len",
            "512", "--max-num-seqs", "64", "--max-num-batched-tokens", "512", "--warmup", "all", "--log-level",
            "warning"]
    lora = ["--enable-lora", "--max-loras", str(args.slots), "--max-lora-rank", str(args.rank), "--lora-modules",
            *(f"{n}={p}" for n, p in zip(names, adapters))]
    results: dict[str, list[dict]] = {}
    for run in range(args.runs):
        for label, flags, workloads in (("no LoRA", [], {"base": ["bench"]}),
                                        ("--enable-lora", lora, {"base": ["bench"], "adapters": names})):
            port = free_port()
            with server([*base, *flags, "--port", str(port)], port) as (url, _):
                asyncio.run(w2(url, ["bench"], 10_000 + 1000 * run))  # (warm-up)
                for workload, models in workloads.items():
                    results.setdefault(f"{label}: {workload}", []).append(
                        asyncio.run(w2(url, models, 1000 * run)))
    table = render(results, args)
    print(table)
    if args.write:
        write_between(MARKERS, table)


def render(results: dict[str, list[dict]], args) -> str:
    reference = results["no LoRA: base"]
    lines = [f"{machine_line()}; `python bench/lora.py --runs {args.runs} --adapters "
             f"{args.adapters} --slots {args.slots} --rank {args.rank}`; the default model (SmolLM2-135M-Instruct "
             "Q4_1), W2 (32 streams); per run, then the ratio to the base model without LoRA in the same run.", "",
             "| server: requests | run | W2 output tok/s | W2 TTFT p50 ms | ratio (tok/s) |",
             "| --- | --- | --- | --- | --- |"]
    for name, runs in results.items():
        for i, (r, ref) in enumerate(zip(runs, reference)):
            lines.append(f"| {name} | {i + 1} | {r['output_tok_s']:.1f} | {1000 * r['ttft_p50']:.0f} | "
                         f"{r['output_tok_s'] / ref['output_tok_s']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
