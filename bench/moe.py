"""Mixture-of-Experts on the CPU backend: the grouped product against the per-expert loop, and a MoE
model's decode against the dense model of the same active parameter count.

    python bench/moe.py [--runs 2] [--rows 1,8,64,256] [--dtype bfloat16] [--skip-models]

1. Products: x [M, hidden] routed top-2 over 8 experts (random routing) through stacked experts
   [8, out, in], as one MoE layer's gate projection is. Side by side in one run:
   - `jaxserve_kernels.grouped_matmul_t`, the CPU's default ("chunked": only the experts that have rows are
     read), on the stack as a model keeps it (a bfloat16 one as raw bits);
   - `jax.lax.ragged_dot` (XLA's CPU lowering: every row against every expert, masked);
   - the per-expert loop: every expert over every row, the rows it does not take masked out (a MoE
     layer written without grouping).
   Reported: ms per product (best of 5) and the ratios to the grouped product.
2. Models: a Mixtral-shaped model (8 experts, top-2, expert intermediate I) and a Llama of the
   same hidden size, layers and attention whose intermediate is 2 I (the same parameters active per
   token), random weights, through `LLM`: decode tokens/s of one stream (a 128-token prompt, 128 new
   tokens) and of 16 streams, and the MoE / dense ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from common import machine_line
from roofline import best_time

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EXPERTS, TOP_K = 8, 2
SHAPE = (2048, 1024)  # [out, in] of one expert's gate projection
MODELS_DIR = Path.home() / ".cache" / "jaxserve-bench" / "moe"
MODEL_SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                   vocab_size=32000, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False)
EXPERT_INTERMEDIATE = 1024


def products(rows: list[int], dtype: str, repeat: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxserve_kernels import grouped_matmul_t
    from jaxserve_kernels.matmul.grouped import kept_as_bits

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((EXPERTS, *SHAPE), np.float32) * 0.02, dtype)
    # (as a model keeps its stacks: a bfloat16 one as raw bits on CPU)
    stack = jax.lax.bitcast_convert_type(w, jnp.uint16) if kept_as_bits(dtype) else w
    grouped = jax.jit(grouped_matmul_t)
    ragged = jax.jit(lambda x, w, sizes: jax.lax.ragged_dot_general(
        x, w, sizes, jax.lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), (0,), (0,))))

    @jax.jit
    def per_expert(x, w, expert):  # every expert over every row, masked
        out = jnp.zeros((x.shape[0], w.shape[1]), jnp.float32)
        for e in range(w.shape[0]):
            y = jnp.einsum("mk,nk->mn", x, w[e], preferred_element_type=jnp.float32)
            out = out + jnp.where((expert == e)[:, None], y, 0)
        return out.astype(x.dtype)

    results = []
    for m in rows:
        tokens = max(1, m // TOP_K)
        expert = np.sort(np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)]).ravel())
        sizes = jnp.asarray(np.bincount(expert, minlength=EXPERTS), jnp.int32)
        x = jnp.asarray(rng.standard_normal((len(expert), SHAPE[1]), np.float32), dtype)
        expert = jnp.asarray(expert, jnp.int32)
        want = np.asarray(per_expert(x, w, expert), np.float32)
        np.testing.assert_allclose(np.asarray(grouped(x, stack, sizes), np.float32), want, atol=0.05, rtol=0.05)
        row = {"rows": int(x.shape[0]), "used": int((np.asarray(sizes) > 0).sum())}
        for name, fn in (("grouped", lambda: grouped(x, stack, sizes).block_until_ready()),
                         ("ragged_dot", lambda: ragged(x, w, sizes).block_until_ready()),
                         ("per-expert loop", lambda: per_expert(x, w, expert).block_until_ready())):
            row[name] = best_time(fn, repeat) * 1e3
        results.append(row)
    return results


def make_models() -> dict[str, Path]:
    """The two random checkpoints (made once, kept in MODELS_DIR)."""
    import torch
    import transformers

    from checkpoints.default_model import write_byte_tokenizer

    made = {}
    for name, cls, extra in (
            ("moe", "Mixtral", dict(intermediate_size=EXPERT_INTERMEDIATE, num_local_experts=EXPERTS,
                                    num_experts_per_tok=TOP_K)),
            ("dense", "Llama", dict(intermediate_size=TOP_K * EXPERT_INTERMEDIATE))):
        path = MODELS_DIR / name
        if not (path / "config.json").is_file():
            torch.manual_seed(0)
            config = getattr(transformers, cls + "Config")(**MODEL_SHAPE, **extra, bos_token_id=None,
                                                            eos_token_id=None, pad_token_id=None)
            getattr(transformers, cls + "ForCausalLM")(config).save_pretrained(path)
            write_byte_tokenizer(path)
        made[name] = path
    return made


def decode_rate(model: Path, dtype: str, streams: int, new_tokens: int = 128, prompt: int = 128) -> float:
    """Decode tokens/s of `streams` sequences generated together (their prefill timed apart)."""
    from jaxserve import LLM, SamplingParams

    llm = LLM(str(model), dtype=dtype, max_model_len=512, max_num_seqs=max(streams, 2),
              max_num_batched_tokens=max(256, prompt), num_pages=1 + streams * 32)
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(0, 256, prompt).tolist()} for _ in range(streams)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # (warm: first use of every shape)
    start = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return streams * (new_tokens - 1) / (time.perf_counter() - start - prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--rows", default="1,8,64,256", help="(token, expert) rows per product")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--skip-models", action="store_true")
    args = parser.parse_args()
    print(f"# {machine_line()}, dtype {args.dtype}")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"\n## grouped product, {EXPERTS} experts of {SHAPE[0]}x{SHAPE[1]}, top-{TOP_K} (ms, best of 5)")
    print("| rows | experts used | run | grouped | ragged_dot | per-expert loop | ragged_dot / grouped | loop / grouped |")
    print("|---|---|---|---|---|---|---|---|")
    for run in range(args.runs):
        for r in products(rows, args.dtype, 5):
            print(f"| {r['rows']} | {r['used']} | {run + 1} | {r['grouped']:.2f} | {r['ragged_dot']:.2f} | "
                  f"{r['per-expert loop']:.2f} | {r['ragged_dot'] / r['grouped']:.1f} | "
                  f"{r['per-expert loop'] / r['grouped']:.1f} |", flush=True)
    if args.skip_models:
        return
    models = make_models()
    print(f"\n## decode: Mixtral-shaped MoE ({EXPERTS} experts of {EXPERT_INTERMEDIATE}, top-{TOP_K}) vs dense "
          f"(intermediate {TOP_K * EXPERT_INTERMEDIATE}), {MODEL_SHAPE['num_hidden_layers']} layers, hidden "
          f"{MODEL_SHAPE['hidden_size']} (tokens/s)")
    print("| streams | run | MoE | dense | MoE / dense |")
    print("|---|---|---|---|---|")
    for run in range(args.runs):
        for streams in (1, 16):
            moe, dense = (decode_rate(models[name], args.dtype, streams) for name in ("moe", "dense"))
            print(f"| {streams} | {run + 1} | {moe:.1f} | {dense:.1f} | {moe / dense:.2f} |", flush=True)


if __name__ == "__main__":
    main()
