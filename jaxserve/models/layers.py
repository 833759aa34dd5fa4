"""The layers every model family is built from, and the types of one step on the paged cache.

A model works on one ragged step: T tokens from up to B sequences, each a prefill chunk or one
decode token (`ModelInputs`). Attention (`attend`) writes the step's keys and values into the
paged cache (`KVCache`), then reads it through `jaxserve_kernels.paged_attention`. Linear weights are
stored [out, in], as Hugging Face stores them, so checkpoints load without a transpose.

A linear layer's or an embedding's matrix may be kept quantized (`Quantizable`, formats of
`jaxserve_kernels.matmul.quant`): the model is built in floats, then `quantize` swaps the matrices named in
the weights' formats for their quantized parameters before any weight is loaded.

LoRA adapters (`Linear.lora`): every adapted layer adds its rows' adapters' products
(`jaxserve.models.lora`).

A family's model is a `Decoder` of its own layers. Nothing here knows a family's names or options:
those live in the family's own file.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.models.lora import LoraRows, lora_delta
from jaxserve.models.rope import apply_rope
from jaxserve_kernels import AXIS, cache_dtype, live_rows, matmul_t, matmul_t_many, paged_attention, write_kv
from jaxserve_kernels.matmul import gated_matmul_t, gated_silu
from jaxserve_kernels.matmul.quant import BLOCK, GroupedRows, QuantizedWeight, dequantize, group_rows, take_rows
from jaxserve_kernels.paged_attention.reference import from_cache, to_cache

if TYPE_CHECKING:
    from jaxserve.models.config import ModelConfig


@flax.struct.dataclass
class KVCache:
    """One K and one V page array per layer, each [num_pages, page_size, num_kv_heads, head_dim]."""

    k: list[jax.Array]
    v: list[jax.Array]


@flax.struct.dataclass
class ReadRows:
    """The token rows a step reads of the last layer's output (the rows sampled, those asked about),
    first: after its attention the last layer computes only those (`Decoder.run`). Only the C++
    kernels skip rows (`live_rows`); elsewhere the engine sends none (`ModelInputs.read_rows`)."""

    order: jax.Array  # i32[T] the rows read, then the others (a permutation of the step's rows)
    count: jax.Array  # i32[] how many are read

    def take(self, x: jax.Array) -> jax.Array:
        """x's rows in `order`."""
        return x[self.order]

    def restore(self, x: jax.Array) -> jax.Array:
        """Rows in `order` (`take`) back in the step's order."""
        rows = self.order.shape[0]
        return x[jnp.zeros(rows, jnp.int32).at[self.order].set(jnp.arange(rows, dtype=jnp.int32))]


def read_only(rows: ReadRows | None, x: jax.Array) -> jax.Array:
    """x, or with `rows`, its rows in their `order`."""
    return x if rows is None else rows.take(x)


def reading(rows: ReadRows | None):
    """Within it the kernels compute only the rows read (`rows.count` first rows: `read_only`)."""
    return contextlib.nullcontext() if rows is None else live_rows(rows.count)


@flax.struct.dataclass
class ModelInputs:
    """Device view of one step. T = padded tokens, B = padded sequences, P = pages per sequence."""

    token_ids: jax.Array  # i32[T]; padding 0
    positions: jax.Array  # i32[T] position of each token in its sequence
    rope: jax.Array  # f32[R, T, head_dim] cos then sin of each token's angles, per rotation (`rope.rope_table`)
    kv_write_index: jax.Array  # i32[T] page * page_size + offset to write K/V; padding -> null page 0
    kv_lens: jax.Array  # i32[B] tokens in the cache after this step; padding 0
    page_table: jax.Array  # i32[B, P]; padding -> null page 0
    query_start: jax.Array  # i32[B + 1] first token row of each sequence; padding repeats the total
    num_seqs: jax.Array  # i32[] real sequences
    logits_indices: jax.Array  # i32[B] row of each sequence's last token
    lora: LoraRows | None = None  # the rows' adapter slots; None: the engine serves no adapters
    steer: jax.Array | None = None  # i32[T] each row's steering slot (S: none); None: the engine steers nothing
    # i32[L + 1] per layer (the last: the final norm) its hidden states' slot (H: none); None: none (`Decoder.run`)
    hidden_slots: jax.Array | None = None
    num_samples: jax.Array | None = None  # i32[] logits rows the sampler reads: the LM head's `live_rows`
    # the rows the step reads of the last layer's output (`ReadRows`); None: every row computed
    read_rows: ReadRows | None = None
    # a batch-invariant step's tile (`invariant.tile_inputs`): attention takes each row alone
    batch_invariant: bool = flax.struct.field(pytree_node=False, default=False)


# Partition rules of the shared layers (parameter path pattern, partition spec, the ModelConfig
# count that must divide the mesh size; see `jaxserve.worker.sharding.weight_sharding`). Megatron-style,
# weights [out, in]: q/k/v and MLP gate/up column-parallel (output split over heads), o and down
# row-parallel; the embedding split over the hidden size, the LM head over the vocabulary (the
# logits come out vocab-sharded); norms replicated.
ATTENTION_RULES = [
    (r"layers\.\d+\.self_attn\.q_proj\.weight", P(AXIS, None), "num_heads"),
    (r"layers\.\d+\.self_attn\.q_proj\.bias", P(AXIS), "num_heads"),
    (r"layers\.\d+\.self_attn\.[kv]_proj\.weight", P(AXIS, None), "num_kv_heads"),
    (r"layers\.\d+\.self_attn\.[kv]_proj\.bias", P(AXIS), "num_kv_heads"),
    (r"layers\.\d+\.self_attn\.o_proj\.weight", P(None, AXIS), "num_heads"),
]
EMBEDDING_RULES = [
    (r"embed_tokens\.embedding", P(None, AXIS), "hidden_size"),
    (r"lm_head\.weight", P(AXIS, None), "vocab_size"),
]


def mlp_rules(module: str = "mlp", count: str = "intermediate_size", bias: bool = False) -> list:
    """The rules of a `GatedMLP` at `layers.N.<module>` whose intermediate size is the count `count`."""
    prefix = r"layers\.\d+\." + module.replace(".", r"\.")
    rules = [(prefix + r"\.(gate|up)_proj\.weight", P(AXIS, None), count)]
    rules += [(prefix + r"\.(gate|up)_proj\.bias", P(AXIS), count)] if bias else []
    return [*rules, (prefix + r"\.down_proj\.weight", P(None, AXIS), count)]


class RMSNorm(nnx.Module):
    """HF's RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


class Quantizable(nnx.Module):
    """A module with one matrix [out, in] (its parameter WEIGHT; [experts, out, in] for stacked
    experts) that may be kept quantized: then the parameter holds the quantized data, beside
    `scales` (and `mins`, int4), with the same leading dimensions; or, kept grouped (`group`), the
    three as one array (`GroupedRows`)."""

    WEIGHT = "weight"
    scales = mins = None  # set by `quantize`
    grouped = False  # set by `group`

    def quantize(self, fmt: str) -> None:
        """Swap the float matrix for the parameters of format `fmt` (zeros, to be loaded)."""
        *lead, width = getattr(self, self.WEIGHT)[...].shape
        packed = width if fmt == "int8" else width // 2
        setattr(self, self.WEIGHT, nnx.Param(jnp.zeros((*lead, packed), jnp.int8 if fmt == "int8" else jnp.uint8)))
        self.scales = nnx.Param(jnp.zeros((*lead, width // BLOCK), jnp.float16))
        self.mins = nnx.Param(jnp.zeros((*lead, width // BLOCK), jnp.float16)) if fmt == "int4" else None

    def group(self) -> None:
        """Keep the quantized matrix grouped (where the loader does: `worker.weights.weight_target`):
        its parts become the one parameter WEIGHT (zeros, to be loaded)."""
        parts = (getattr(self, self.WEIGHT), self.scales, self.mins)
        rows = QuantizedWeight(*(None if part is None else jnp.zeros(part.shape, part.dtype) for part in parts))
        setattr(self, self.WEIGHT, nnx.Param(group_rows(rows, jnp).data))
        self.scales = self.mins = None
        self.grouped = True

    def matrix(self) -> jax.Array | QuantizedWeight:
        """What `matmul_t` takes: the float matrix, or its quantized parts (grouped: its one array)."""
        weight = getattr(self, self.WEIGHT)[...]
        if self.grouped:
            return GroupedRows(weight, None)
        if self.scales is None:
            return weight
        return QuantizedWeight(weight, self.scales[...], None if self.mins is None else self.mins[...])


class Linear(Quantizable):
    """y = x W^T + b. The product accumulates in float32 and returns the input dtype
    (`jaxserve_kernels.matmul_t`, which picks the backend's implementation). With adapters attached
    (`attach_adapters`) and the step's `LoraRows`, each row adds its adapter's product."""

    lora: tuple[jax.Array, jax.Array] | None = None  # the slots' (A, B) stacks (`lora_delta`), for one trace

    def __init__(self, d_in: int, d_out: int, bias: bool, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(nnx.initializers.lecun_normal(in_axis=1, out_axis=0)(rngs.params(), (d_out, d_in),
                                                                                     dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x, adapters: LoraRows | None = None):
        return self.finish(x, matmul_t(x, self.matrix()), adapters)

    def plain(self, adapters: LoraRows | None) -> bool:
        """Whether the layer is its product alone for these rows (`finish` adds nothing to it)."""
        return self.bias is None and (adapters is None or self.lora is None)

    def finish(self, x, y, adapters: LoraRows | None = None):
        """x W^T (y) -> the layer's output: the row's adapter's product and the bias added."""
        if adapters is not None and self.lora is not None:
            y = y + lora_delta(x, *self.lora, adapters)
        return y if self.bias is None else y + self.bias[...]


def project(x, linears: list[Linear], adapters: LoraRows | None = None) -> list[jax.Array]:
    """[linear(x, adapters) for linear in linears]: the layers of one input (q, k and v; gate and up),
    their products in one call where the kernel takes them together (`jaxserve_kernels.matmul_t_many`)."""
    ys = matmul_t_many(x, [linear.matrix() for linear in linears])
    return [linear.finish(x, y, adapters) for linear, y in zip(linears, ys)]


class Embedding(Quantizable):
    """Token embeddings [vocab, hidden] (under NNX's `Embed`'s parameter name); its matrix is also a
    tied LM head's weight."""

    WEIGHT = "embedding"

    def __init__(self, vocab_size: int, dim: int, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
        self.embedding = nnx.Param(init(rngs.params(), (vocab_size, dim), dtype))
        self.dtype = dtype

    def __call__(self, token_ids):
        table = self.matrix()
        if isinstance(table, QuantizedWeight):  # only the rows looked up are dequantized
            return dequantize(take_rows(table, token_ids), self.dtype)
        return table[token_ids]


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)): the feed-forward block of Llama-like models (SiLU; Gemma's GeGLU
    passes the tanh GELU)."""

    def __init__(self, d: int, intermediate: int, bias: bool, dtype, rngs: nnx.Rngs, activation=jax.nn.silu):
        self.gate_proj = Linear(d, intermediate, bias, dtype, rngs)
        self.up_proj = Linear(d, intermediate, bias, dtype, rngs)
        self.down_proj = Linear(intermediate, d, bias, dtype, rngs)
        self.activation = activation

    def __call__(self, x, adapters: LoraRows | None = None):
        linears = [self.gate_proj, self.up_proj]
        h = None
        if self.activation is jax.nn.silu and all(linear.plain(adapters) for linear in linears):
            h = gated_matmul_t(x, *(linear.matrix() for linear in linears))
        if h is None:
            h = gated(self.activation, *project(x, linears, adapters), token_rows=True)
        return self.down_proj(h, adapters)


def gated(activation, gate: jax.Array, up: jax.Array, token_rows: bool = False) -> jax.Array:
    """activation(gate) * up, the activation computed in float32 and rounded once to gate's dtype, as
    torch's bfloat16 kernels do: applied in bfloat16, XLA rounds each of its steps (values off torch's)
    and XLA:CPU runs it slower. SiLU's by the C++ kernel where it runs (`gated_silu`; `token_rows`:
    gate's rows are the step's tokens, of which it computes only the real ones)."""
    fused = gated_silu(gate, up, token_rows=token_rows) if activation is jax.nn.silu else None
    return fused if fused is not None else activation(gate.astype(jnp.float32)).astype(gate.dtype) * up


def only_if(asked: jax.Array, fn, *operands):
    """fn(*operands) where `asked`, else the first operand unchanged: a conditional, so that a step pays
    nothing for what no row asks; on GPU always fn (there a conditional costs more than it skips)."""
    if jax.default_backend() == "gpu":
        return fn(*operands)
    return jax.lax.cond(asked, fn, lambda first, *_: first, *operands)


def gather_state(hidden: jax.Array, x: jax.Array, slot: jax.Array, num_hidden: int, norm=None) -> jax.Array:
    """`hidden` ([num_hidden + 1, T, hidden], the cache's element type) with slot `slot` set to the rows
    of x (after `norm`), unless no row asks for them (slot num_hidden). Left unconditional, XLA:CPU
    fused a step's writes into one pass over every layer's output (bench/RESULTS.md, "The residual
    stream's writes, skipped where no row asks")."""
    def write(hidden, x):
        x = x if norm is None else norm(x)
        # (a slot is always in range: an update in place, with no bounds checks as calls of their own)
        return jax.lax.dynamic_update_index_in_dim(hidden, to_cache(x, hidden), slot, 0)

    return only_if(slot < num_hidden, write, hidden, x)


def attend(q, k, v, k_pages, v_pages, inputs: ModelInputs, *, sm_scale: float | None = None,
           sliding_window: int | None = None, soft_cap: float | None = None):
    """Write the step's keys and values into the cache, then attend over it.
    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]; pages: see `KVCache`; `sm_scale`
    defaults to head_dim ** -0.5. -> ([T, heads, head_dim], k_pages, v_pages)."""
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, inputs.kv_write_index)
    o = paged_attention(q, k_pages, v_pages, inputs.kv_lens, inputs.page_table, inputs.query_start,
                        inputs.num_seqs, sm_scale=q.shape[-1]**-0.5 if sm_scale is None else sm_scale,
                        sliding_window=sliding_window, soft_cap=soft_cap, row_by_row=inputs.batch_invariant)
    return o, k_pages, v_pages


class Attention(nnx.Module):
    """Self-attention on the paged cache: q/k/v projections, an optional per-head norm of q and k
    (Qwen3, Gemma 3), RoPE by one of the step's tables, `attend`, the output projection. What sets
    a layer apart is given per layer: a sliding window, logit soft-capping, the scale, the rotation."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, *, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm=None, sliding_window: int | None = None, soft_cap: float | None = None,
                 sm_scale: float | None = None, rope_index: int = 0):
        """`qk_norm`: None, or the norm class (`RMSNorm`, or a family's) built per head as (head_dim, eps, dtype)."""
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.sliding_window, self.soft_cap, self.sm_scale, self.rope_index = sliding_window, soft_cap, sm_scale, rope_index
        self.q_proj = Linear(d, cfg.num_heads * hd, qkv_bias, dtype, rngs)
        self.k_proj = Linear(d, cfg.num_kv_heads * hd, qkv_bias, dtype, rngs)
        self.v_proj = Linear(d, cfg.num_kv_heads * hd, qkv_bias, dtype, rngs)
        self.o_proj = Linear(cfg.num_heads * hd, d, o_bias, dtype, rngs)
        self.q_norm = qk_norm(hd, cfg.rms_norm_eps, dtype) if qk_norm is not None else None
        self.k_norm = qk_norm(hd, cfg.rms_norm_eps, dtype) if qk_norm is not None else None

    def __call__(self, x, k_pages, v_pages, inputs: ModelInputs, rows: ReadRows | None = None):
        """-> (the output projection's rows: all, or with `rows` those it reads, in their order
        (`read_only`), k_pages, v_pages)."""
        t = x.shape[0]
        q, k, v = project(x, [self.q_proj, self.k_proj, self.v_proj], inputs.lora)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k, v = (y.reshape(t, self.num_kv_heads, self.head_dim) for y in (k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = inputs.rope[self.rope_index]
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        o, k_pages, v_pages = attend(q, k, v, k_pages, v_pages, inputs, sm_scale=self.sm_scale,
                                     sliding_window=self.sliding_window, soft_cap=self.soft_cap)
        o = read_only(rows, o.reshape(t, self.num_heads * self.head_dim))
        with reading(rows):
            return self.o_proj(o, inputs.lora), k_pages, v_pages


class Decoder(nnx.Module):
    """What every family's model does around its layers: embed the tokens, run the layers in turn
    (each on its own pages), then, for the rows asked, the final norm and the LM head (tied: the
    embedding matrix), soft-capped where the family caps its logits. A family gives its layers
    (and its norm class), and may override `embed`."""

    final_soft_cap: float | None = None  # logits c * tanh(logits / c) (Gemma)
    steering: jax.Array | None = None  # [L, S + 1, hidden] each slot's vector per layer (the last slot: zeros)

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, layers: list[nnx.Module], norm=RMSNorm):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, rngs)
        self.layers = nnx.List(layers)
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, rngs)

    def embed(self, token_ids: jax.Array) -> jax.Array:
        return self.embed_tokens(token_ids)

    def __call__(self, kv: KVCache, inputs: ModelInputs) -> tuple[KVCache, jax.Array]:
        """-> (updated cache, [T, hidden] the last layer's output at every token, or with
        `inputs.read_rows` at the rows read (the others: any values): see `logits`)."""
        kv, x, _ = self.run(kv, inputs)
        return kv, x

    def run(self, kv: KVCache, inputs: ModelInputs, num_hidden: int = 0
            ) -> tuple[KVCache, jax.Array, jax.Array | None]:
        """`__call__`, adding each row's steering vector (`steering`, set for one trace by
        `forward_residual`) to the residual stream after each layer, and gathering the residual stream after the layers of
        `inputs.hidden_slots` (steered) into `num_hidden` slots -> (cache, output, [num_hidden, T,
        hidden] or None). Unsteered rows add the zero slot; unasked layers write a slot dropped at the end."""
        x = self.embed(inputs.token_ids)
        gather = num_hidden > 0 and inputs.hidden_slots is not None
        # (made in the dtype of the layers' outputs, as the KV cache's bits on CPU (`cache_dtype`): a
        # write that converts is not done in place, and XLA:CPU widens a bfloat16 one over the buffer)
        hidden = None
        steered = None  # whether any row of the step is steered
        if self.steering is not None and inputs.steer is not None:
            steered = jnp.any(inputs.steer < self.steering.shape[1] - 1)
        k_out, v_out = [], []
        last = len(self.layers) - 1
        for i, (layer, k_pages, v_pages) in enumerate(zip(self.layers, kv.k, kv.v)):
            if i == last and inputs.read_rows is not None:  # (the rows no one reads: the cache's keys alone)
                x, k_pages, v_pages = layer(x, k_pages, v_pages, inputs, inputs.read_rows)
                x = inputs.read_rows.restore(x)
            else:
                x, k_pages, v_pages = layer(x, k_pages, v_pages, inputs)
            if steered is not None:  # (each row's vector: its slot's; the last slot is zeros)
                x = only_if(steered, lambda x, i=i: x + self.steering[i][inputs.steer].astype(x.dtype), x)
            if gather:
                hidden = jnp.zeros((num_hidden + 1, *x.shape), cache_dtype(x.dtype)) if hidden is None else hidden
                hidden = gather_state(hidden, x, inputs.hidden_slots[i], num_hidden)
            k_out.append(k_pages)
            v_out.append(v_pages)
        if gather:
            hidden = gather_state(hidden, x, inputs.hidden_slots[len(self.layers)], num_hidden, self.norm)
            hidden = from_cache(hidden[:num_hidden])
        return KVCache(k=k_out, v=v_out), x, hidden

    def logits(self, x: jax.Array) -> jax.Array:
        """The final norm and the LM head: [N, hidden] rows of `__call__`'s output -> f32[N, vocab]."""
        head = (self.embed_tokens if self.lm_head is None else self.lm_head).matrix()
        logits = matmul_t(self.norm(x), head, jnp.float32)
        if self.final_soft_cap is not None:
            logits = self.final_soft_cap * jnp.tanh(logits / self.final_soft_cap)
        return logits
