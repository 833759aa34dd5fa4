"""The Mixture-of-Experts family (Mixtral, Qwen2-MoE, Qwen3-MoE) on the shared layers, in Flax NNX.

A layer's feed-forward block is sparse: a router picks each token's top-k experts (softmax over
the experts in float32, top-k, renormalised where the model does), and the token's output is the
weighted sum of those experts' gated MLPs (plus, in Qwen2-MoE, a shared expert scaled by its
sigmoid gate). Some layers may keep a dense MLP instead (Qwen's `mlp_only_layers`,
`decoder_sparse_step`).

Each expert matrix is stacked over the experts, [experts, out, in] (Hugging Face's [out, in] per
expert), in a `Quantizable` module of its own, so it may be kept quantized like any linear layer;
the router stays in floats. Tokens are sorted by expert and multiplied by `jaxserve_kernels.grouped_matmul_t`:
no token meets an expert it was not routed to.

Under tensor parallelism the experts' matrices are split along their intermediate dimension, as a
dense MLP is, and XLA partitions the products. With expert parallelism
(`ModelConfig.expert_parallel`) attention stays tensor-parallel, and the experts are split whole
over the same devices: each device runs its experts' share of the tokens and the partial outputs
are summed over the mesh (`jax.shard_map`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.models.layers import (ATTENTION_RULES, EMBEDDING_RULES, Attention, Decoder, GatedMLP, ModelInputs,
                                    Quantizable, ReadRows, RMSNorm, gated, mlp_rules, read_only, reading)
from jaxserve_kernels import AXIS, grouped_matmul_t, matmul_t

if TYPE_CHECKING:
    from jaxserve.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class MoeOptions:
    """What sets the family's architectures apart, as config.json gives it."""

    qkv_bias: bool  # biases on q/k/v projections (Qwen2-MoE's qkv_bias, Qwen3-MoE's attention_bias)
    o_bias: bool  # bias on the output projection (Qwen3-MoE's attention_bias)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3-MoE)
    sliding_window: int | None  # attend to at most this many most recent positions (Mixtral)
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # each expert's intermediate size
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    shared_expert_intermediate_size: int  # 0: no shared expert
    dense_layers: tuple[int, ...]  # layers with a dense MLP of intermediate_size instead of experts


def options_from_hf(architecture: str, hf: dict, path: Path) -> MoeOptions:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu'), in {path}")
    if hf.get("use_sliding_window"):
        raise ValueError(f"use_sliding_window=true (per-layer windows) is not supported yet, in {path}")
    num_experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
    top_k = hf.get("num_experts_per_tok", 0)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in [1, {num_experts}] (the experts), in {path}")
    if architecture == "MixtralForCausalLM":
        return MoeOptions(qkv_bias=False, o_bias=False, qk_norm=False, sliding_window=hf.get("sliding_window"),
                          num_experts_per_tok=top_k, moe_intermediate_size=hf["intermediate_size"],
                          norm_topk_prob=True, shared_expert_intermediate_size=0, dense_layers=())
    qwen2 = architecture == "Qwen2MoeForCausalLM"
    attention_bias = bool(hf.get("attention_bias", False))
    step = hf.get("decoder_sparse_step", 1) or 1
    only_mlp = set(hf.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(hf["num_hidden_layers"]) if i in only_mlp or (i + 1) % step)
    return MoeOptions(qkv_bias=bool(hf.get("qkv_bias", True)) if qwen2 else attention_bias,
                      o_bias=False if qwen2 else attention_bias, qk_norm=not qwen2, sliding_window=None,
                      num_experts_per_tok=top_k, moe_intermediate_size=hf["moe_intermediate_size"],
                      norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                      shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) if qwen2 else 0,
                      dense_layers=dense)


_EXPERT = r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)"
# HF tensor name pattern -> parameter path (`re.sub` template); an expert's matrix is one slice of
# its layer's stacked parameter ("...weight[3]": expert 3)
HF_NAME_MAP = {
    r"model\.embed_tokens\.weight": r"embed_tokens.embedding",
    r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.weight": r"layers.\1.\2.\3.weight",
    r"model\.layers\.(\d+)\.self_attn\.(\w+_proj)\.bias": r"layers.\1.self_attn.\2.bias",
    r"model\.layers\.(\d+)\.self_attn\.(q_norm|k_norm)\.weight": r"layers.\1.self_attn.\2.weight",
    r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight": r"layers.\1.\2.weight",
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)\.weight": r"layers.\1.mlp.experts.\3.weight[\2]",
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight": r"layers.\1.mlp.gate.weight",
    r"model\.layers\.(\d+)\.mlp\.shared_expert\.(\w+_proj)\.weight": r"layers.\1.mlp.shared_expert.\2.weight",
    r"model\.layers\.(\d+)\.mlp\.shared_expert_gate\.weight": r"layers.\1.mlp.shared_expert_gate.weight",
    # Mixtral's experts: w1 gate, w3 up, w2 down
    _EXPERT + r"\.w1\.weight": r"layers.\1.mlp.experts.gate_proj.weight[\2]",
    _EXPERT + r"\.w3\.weight": r"layers.\1.mlp.experts.up_proj.weight[\2]",
    _EXPERT + r"\.w2\.weight": r"layers.\1.mlp.experts.down_proj.weight[\2]",
    r"model\.norm\.weight": r"norm.weight",
    r"lm_head\.weight": r"lm_head.weight",
}
TIED_HEAD = frozenset({"lm_head.weight"})  # what a checkpoint of tied embeddings may hold but the model lacks

# The experts' stacked matrices [experts, out, in] split along their intermediate dimension (gate/up
# column-parallel, down row-parallel); routers replicated.
PARTITION_RULES = [
    *ATTENTION_RULES, *mlp_rules(),
    (r"layers\.\d+\.mlp\.experts\.(gate|up)_proj\.weight", P(None, AXIS, None), "moe_intermediate_size"),
    (r"layers\.\d+\.mlp\.experts\.down_proj\.weight", P(None, None, AXIS), "moe_intermediate_size"),
    *mlp_rules("mlp.shared_expert", "shared_expert_intermediate_size"), *EMBEDDING_RULES,
]
EXPERT_PARALLEL_RULES = [
    (r"layers\.\d+\.mlp\.experts\.(gate|up|down)_proj\.weight", P(AXIS, None, None), "num_experts"),
]


class ExpertLinear(Quantizable):
    """The experts' matrices of one projection, stacked: [experts, out, in]."""

    def __init__(self, num_experts: int, d_in: int, d_out: int, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(in_axis=2, out_axis=1)
        self.weight = nnx.Param(init(rngs.params(), (num_experts, d_out, d_in), dtype))


class Experts(nnx.Module):
    """The experts' gated MLPs (SiLU), each projection stacked over the experts."""

    def __init__(self, num_experts: int, d: int, intermediate: int, dtype, rngs: nnx.Rngs):
        self.gate_proj = ExpertLinear(num_experts, d, intermediate, dtype, rngs)
        self.up_proj = ExpertLinear(num_experts, d, intermediate, dtype, rngs)
        self.down_proj = ExpertLinear(num_experts, intermediate, d, dtype, rngs)


class Router(nnx.Module):
    """A float [out, hidden] projection computed in float32: a router (out = experts) or a shared
    expert's gate (out = 1). Never quantized: its errors would move tokens between experts."""

    def __init__(self, d: int, d_out: int, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (d_out, d), dtype))

    def __call__(self, x):
        return matmul_t(x.astype(jnp.float32), self.weight[...].astype(jnp.float32))


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """f32[T, experts] router logits -> (f32[T, k] weights, i32[T, k] experts): the softmax's top k,
    renormalised to sum to 1 where `normalize`."""
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    if normalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts


def expert_outputs(x, weights, experts, gate, up, down, first_expert=0):
    """The weighted sum over each token's experts of their gated MLPs, for the experts held here:
    `gate`, `up`, `down` are experts first_expert .. first_expert + E - 1 ([E, out, in] or quantized
    parts); tokens' other experts contribute nothing. x [T, H]; weights f32[T, k]; experts
    i32[T, k] -> f32[T, H]."""
    t, k = experts.shape
    held = gate.shape[0]
    local = experts - first_expert
    mine = (local >= 0) & (local < held)
    group = jnp.where(mine, local, held).reshape(-1)  # others sort after every expert held here
    order = jnp.argsort(group, stable=True)
    sizes = jnp.zeros(held + 1, jnp.int32).at[group].add(1)[:held]
    rows = x[order // k]  # [T * k, H], sorted by expert
    h = gated(jax.nn.silu, grouped_matmul_t(rows, gate, sizes), grouped_matmul_t(rows, up, sizes))
    out = jnp.zeros((t * k, x.shape[1]), jnp.float32).at[order].set(grouped_matmul_t(h, down, sizes, jnp.float32))
    scaled = jnp.where(mine[..., None], out.reshape(t, k, -1) * weights[..., None], 0)
    return scaled.sum(1)


class SparseMoeBlock(nnx.Module):
    """Router, experts, and an optional shared expert with its sigmoid gate (Qwen2-MoE)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        options = cfg.options
        d = cfg.hidden_size
        self.top_k, self.normalize, self.expert_parallel = (options.num_experts_per_tok, options.norm_topk_prob,
                                                           cfg.expert_parallel)
        self.gate = Router(d, cfg.num_experts, dtype, rngs)
        self.experts = Experts(cfg.num_experts, d, options.moe_intermediate_size, dtype, rngs)
        shared = options.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(d, shared, False, dtype, rngs) if shared else None
        self.shared_expert_gate = Router(d, 1, dtype, rngs) if shared else None

    def __call__(self, x, adapters=None):
        """(`adapters`: the step's LoRA rows, which no layer here takes: only attention and dense
        MLPs are adapted, `models.ADAPTABLE`)"""
        weights, experts = route(self.gate(x), self.top_k, self.normalize)
        matrices = (self.experts.gate_proj.matrix(), self.experts.up_proj.matrix(), self.experts.down_proj.matrix())
        mesh = jax.sharding.get_abstract_mesh()
        devices = 1 if mesh.empty else mesh.shape.get(AXIS, 1)
        if self.expert_parallel and devices > 1:
            y = jax.shard_map(_expert_shard, mesh=mesh, in_specs=(P(), P(), P(), P(AXIS), P(AXIS), P(AXIS)),
                              out_specs=P(), check_vma=False)(x, weights, experts, *matrices)
        else:
            y = expert_outputs(x, weights, experts, *matrices)
        if self.shared_expert is not None:
            y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x).astype(jnp.float32)
        return y.astype(x.dtype)


def _expert_shard(x, weights, experts, gate, up, down):
    first = jax.lax.axis_index(AXIS) * gate.shape[0]
    return jax.lax.psum(expert_outputs(x, weights, experts, gate, up, down, first), AXIS)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype, rngs: nnx.Rngs):
        options = cfg.options
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs, qkv_bias=options.qkv_bias, o_bias=options.o_bias,
                                   qk_norm=RMSNorm if options.qk_norm else None, sliding_window=options.sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = (GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, dtype, rngs)
                    if index in options.dense_layers else SparseMoeBlock(cfg, dtype, rngs))

    def __call__(self, x, k_pages, v_pages, inputs: ModelInputs, rows: ReadRows | None = None):
        h, k_pages, v_pages = self.self_attn(self.input_layernorm(x), k_pages, v_pages, inputs, rows)
        with reading(rows):
            x = read_only(rows, x) + h
            x = x + self.mlp(self.post_attention_layernorm(x), inputs.lora)
        return x, k_pages, v_pages


class MoeDecoder(Decoder):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, dtype, rngs, [DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])

