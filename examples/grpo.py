"""GRPO in pure JAX + optax, with jaxserve as the sampler: a small Llama learns a verifiable toy task.

The task: answer any prompt with digits. The reward of a completion is the share of its tokens that
are digits ("0".."9"): no model to judge it, a rule checks it. Each step samples a group of
completions per prompt, scores them, gives each its advantage within its group (reward minus the
group's mean, over the group's spread), and takes one policy-gradient step on them; the new weights
then go to the sampler, and the next step's rollouts come from them.

The trainer's parameters are the checkpoint's tensors by Hugging Face name, and its forward pass
(`logits`) is written here in a few lines of jax.numpy. They reach the sampler:
- in-process (the default): `LLM.update_weights`, arrays handed over on the device (no copy, no
  serialization; `LLM.params_from_hf` maps the names);
- over HTTP (`--server URL`, a `run_server.py` of the same model): the tensors streamed to POST
  /update_weights as a safetensors body, the rollouts from POST /inference/v1/generate.

    python examples/grpo.py --steps 30                       # jaxserve-tiny, in this process
    python run_server.py --model jaxserve-tiny --dtype float32 &
    python examples/grpo.py --steps 30 --server http://127.0.0.1:8000

See docs/rl.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from safetensors.numpy import load_file, save

CHUNK = 1 << 22  # bytes of the weights sent at a time
DIGITS = np.arange(ord("0"), ord("9") + 1)  # their ids under jaxserve-tiny's byte-level tokenizer


def rms_norm(x, weight, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x, theta: float):
    """Rotate x [T, heads, head_dim] by its positions (Hugging Face's halves convention)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / theta ** (jnp.arange(half) / half)
    angles = jnp.arange(x.shape[0])[:, None] * freqs[None]
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def logits(params: dict, tokens: jax.Array, cfg: dict) -> jax.Array:
    """A Llama's logits [T, vocab] for one sequence of token ids [T] (causal attention)."""
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    eps, theta, T = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0), tokens.shape[0]
    x = params["model.embed_tokens.weight"][tokens]
    mask = jnp.tril(jnp.ones((T, T), bool))
    for i in range(cfg["num_hidden_layers"]):
        p = lambda name: params[f"model.layers.{i}.{name}.weight"]  # noqa: E731
        h = rms_norm(x, p("input_layernorm"), eps)
        q = rope((h @ p("self_attn.q_proj").T).reshape(T, heads, dim), theta)
        k = rope((h @ p("self_attn.k_proj").T).reshape(T, kv_heads, dim), theta)
        v = (h @ p("self_attn.v_proj").T).reshape(T, kv_heads, dim)
        k, v = (jnp.repeat(a, heads // kv_heads, axis=1) for a in (k, v))
        scores = jnp.einsum("qhd,khd->hqk", q, k) / jnp.sqrt(dim)
        attn = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        x = x + jnp.einsum("hqk,khd->qhd", attn, v).reshape(T, heads * dim) @ p("self_attn.o_proj").T
        h = rms_norm(x, p("post_attention_layernorm"), eps)
        x = x + (jax.nn.silu(h @ p("mlp.gate_proj").T) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
    head = params.get("lm_head.weight", params["model.embed_tokens.weight"])
    return rms_norm(x, params["model.norm.weight"], eps) @ head.T


def reward(completion: list[int]) -> float:
    return float(np.isin(completion, DIGITS).mean()) if completion else 0.0


def grpo_loss(params, tokens, completion_mask, advantages, cfg):
    """-(advantage x the completion's log-likelihood), per completion token, over the batch
    (on-policy: the policy ratio is 1, so GRPO's clipping never acts; one step per batch)."""
    def sequence(tokens, mask, advantage):
        logp = jax.nn.log_softmax(logits(params, tokens[:-1], cfg))
        token_logp = jnp.take_along_axis(logp, tokens[1:, None], axis=-1)[:, 0]
        return -advantage * jnp.sum(token_logp * mask[1:])
    return jnp.sum(jax.vmap(sequence)(tokens, completion_mask, advantages)) / jnp.sum(completion_mask)


class InProcess:
    """jaxserve's `LLM` in this process: the sampler of the rollouts and the holder of new weights."""

    def __init__(self, model: str, engine: dict):
        from jaxserve import LLM, SamplingParams

        self.llm, self.SamplingParams = LLM(model, **engine), SamplingParams

    def rollouts(self, prompts: list[list[int]], group: int, max_tokens: int, seed: int) -> list[list[list[int]]]:
        params = self.SamplingParams(n=group, temperature=1.0, max_tokens=max_tokens, seed=seed, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[list(c.token_ids) for c in out.outputs] for out in outs]

    def update(self, params: dict, version: int) -> None:
        self.llm.update_weights(self.llm.params_from_hf(params), weight_version=version)


class OverHTTP:
    """A `run_server.py` of the same model: rollouts from /inference/v1/generate, new weights to
    /update_weights."""

    def __init__(self, url: str):
        import httpx

        self.client = httpx.Client(base_url=url, timeout=600)

    def rollouts(self, prompts: list[list[int]], group: int, max_tokens: int, seed: int) -> list[list[list[int]]]:
        out = []
        for i, prompt in enumerate(prompts):
            body = {"token_ids": prompt, "sampling_params": {"n": group, "temperature": 1.0, "max_tokens": max_tokens,
                                                             "seed": seed + i, "ignore_eos": True}}
            answer = self.client.post("/inference/v1/generate", json=body).raise_for_status().json()
            out.append([c["token_ids"] for c in sorted(answer["choices"], key=lambda c: c["index"])])
        return out

    def update(self, params: dict, version: int) -> None:
        body = memoryview(save({name: np.asarray(x) for name, x in params.items()}))
        pieces = (body[i:i + CHUNK] for i in range(0, len(body), CHUNK))  # (chunked: httpx sends a large bytes slowly)
        self.client.post("/update_weights", params={"weight_version": version}, content=pieces).raise_for_status()


def train(sampler, model_dir: Path, steps: int, prompts: int = 4, group: int = 8, max_tokens: int = 8,
          learning_rate: float = 3e-3, seed: int = 0, log=print) -> list[float]:
    """GRPO's loop -> the mean reward of each step's rollouts."""
    cfg = json.loads((model_dir / "config.json").read_text())
    params = {name: jnp.asarray(x, jnp.float32) for name, x in load_file(model_dir / "model.safetensors").items()}
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(params)
    grad = jax.jit(jax.grad(grpo_loss), static_argnames="cfg")
    rng = np.random.default_rng(seed)
    history = []
    for step in range(steps):
        batch = [rng.integers(ord("a"), ord("z") + 1, size=6).tolist() for _ in range(prompts)]
        groups = sampler.rollouts(batch, group, max_tokens, seed=seed * 100_000 + step * 100)
        rewards = np.array([[reward(c) for c in g] for g in groups])
        advantages = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-4)
        length = len(batch[0]) + max_tokens
        tokens = np.zeros((prompts * group, length), np.int32)
        mask = np.zeros((prompts * group, length), np.float32)
        for row, (prompt, completion) in enumerate((p, c) for p, g in zip(batch, groups) for c in g):
            tokens[row, :len(prompt) + len(completion)] = prompt + completion
            mask[row, len(prompt):len(prompt) + len(completion)] = 1
        grads = grad(params, tokens, mask, advantages.reshape(-1), cfg=_Frozen(cfg))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        sampler.update(params, version=step + 1)
        history.append(float(rewards.mean()))
        log(f"step {step}: mean reward {history[-1]:.3f}")
    return history


class _Frozen(dict):
    """The model's config as a static (hashable) argument of the jitted gradient."""

    def __hash__(self):
        return hash(json.dumps(self, sort_keys=True))


ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=32, max_num_batched_tokens=64, page_size=16)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--server", help="a run_server.py of jaxserve-tiny (default: an LLM in this process)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from checkpoints import default_model_dir

    sampler = OverHTTP(args.server) if args.server else InProcess("jaxserve-tiny", ENGINE)
    history = train(sampler, default_model_dir(), args.steps, seed=args.seed)
    print(f"mean reward: {history[0]:.3f} at the first step, {np.mean(history[-5:]):.3f} over the last five")


if __name__ == "__main__":
    sys.exit(main())
