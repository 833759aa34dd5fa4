"""The models: shared layers (`layers.py`), one file per family, and the registry that finds a
family by the Hugging Face architecture name in config.json (`MODEL_REGISTRY`).

A model is an NNX module of (KV cache, step inputs) -> (cache, hidden states), with `logits` for
the rows that need them. The engine splits it once (`nnx.split`) and merges it inside its jitted
step (`forward`), so no NNX object walk happens per call. Nothing here knows about scheduling,
sampling or HTTP. docs/adding_a_model.md walks through adding a family.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from jaxserve_kernels import live_rows

from jaxserve.models import gemma, invariant, llama, moe, phi3
from jaxserve.models.layers import KVCache, Linear, ModelInputs, Quantizable, ReadRows
from jaxserve.models.lora import LoraRows
from jaxserve.models.rope import RopeConfig, rope_table, ropes_from_hf

if TYPE_CHECKING:
    from jaxserve.models.config import ModelConfig

# a family's own settings (`ModelConfig.options`): one type per family
ModelOptions = llama.LlamaOptions | gemma.GemmaOptions | moe.MoeOptions


def whole_config(architecture: str, hf: dict) -> dict:
    """A family's `decoder_config` when config.json's top level describes the decoder as it is."""
    return hf


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """Everything jaxserve looks up by architecture name."""

    name: str
    options_from_hf: Callable[[str, dict, Path], ModelOptions]  # (architecture, decoder config, its path) -> options
    model: Callable[[ModelConfig, jax.typing.DTypeLike, nnx.Rngs], nnx.Module]  # (cfg, dtype, rngs) -> the module
    hf_name_map: Mapping[str, str]  # HF tensor name pattern -> parameter path (`re.sub` template)
    partition_rules: Sequence[tuple[str, PartitionSpec, str]]  # see `jaxserve.worker.sharding.weight_sharding`
    tied_head: frozenset[str]  # parameter paths a checkpoint may hold that tied embeddings leave out
    # (architecture, decoder config, config.json's path) -> `ModelConfig.ropes`: the rotations the
    # layers use, the model's own first
    ropes_from_hf: Callable[[str, dict, Path], tuple[RopeConfig, ...]] = ropes_from_hf
    # (architecture, config.json) -> the decoder's config, which every other hook and `ModelConfig`
    # read: the text model of an image-text checkpoint, the family's defaults for fields left out
    decoder_config: Callable[[str, dict], dict] = whole_config
    skipped_tensors: str | None = None  # HF tensor names a checkpoint holds that the model never loads
    # with expert parallelism (`ModelConfig.expert_parallel`), taken before `partition_rules`; a
    # family without them has no experts to split
    expert_parallel_rules: Sequence[tuple[str, PartitionSpec, str]] = ()

    def rules(self, cfg: ModelConfig) -> tuple[tuple[str, PartitionSpec, str], ...]:
        return (*(self.expert_parallel_rules if cfg.expert_parallel else ()), *self.partition_rules)


LLAMA = ModelFamily(name="llama", options_from_hf=llama.options_from_hf, model=llama.LlamaDecoder,
                    hf_name_map=llama.HF_NAME_MAP, partition_rules=llama.PARTITION_RULES, tied_head=llama.TIED_HEAD)
# Phi-3 is Llama's decoder; only its checkpoints (fused tensors) and its rotation differ
PHI3 = ModelFamily(name="phi3", options_from_hf=phi3.options_from_hf, model=llama.LlamaDecoder,
                   hf_name_map=phi3.HF_NAME_MAP, partition_rules=llama.PARTITION_RULES, tied_head=llama.TIED_HEAD,
                   decoder_config=phi3.decoder_config)
MOE = ModelFamily(name="moe", options_from_hf=moe.options_from_hf, model=moe.MoeDecoder, hf_name_map=moe.HF_NAME_MAP,
                  partition_rules=moe.PARTITION_RULES, tied_head=moe.TIED_HEAD,
                  expert_parallel_rules=moe.EXPERT_PARALLEL_RULES)
GEMMA = ModelFamily(name="gemma", options_from_hf=gemma.options_from_hf, model=gemma.GemmaDecoder,
                    hf_name_map=gemma.HF_NAME_MAP, partition_rules=gemma.PARTITION_RULES, tied_head=gemma.TIED_HEAD,
                    ropes_from_hf=gemma.ropes_from_hf, decoder_config=gemma.decoder_config,
                    skipped_tensors=gemma.SKIPPED_TENSORS)

# HF `architectures` entry -> its family
MODEL_REGISTRY: dict[str, ModelFamily] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,
    "Qwen3ForCausalLM": LLAMA,
    "Phi3ForCausalLM": PHI3,
    "MixtralForCausalLM": MOE,
    "Qwen2MoeForCausalLM": MOE,
    "Qwen3MoeForCausalLM": MOE,
    "Gemma2ForCausalLM": GEMMA,
    "Gemma3ForCausalLM": GEMMA,
    "Gemma3ForConditionalGeneration": GEMMA,  # its text model; requests with images are refused by the API
}

# base models without an LM head (embedding checkpoints: `--runner pooling`) -> their causal LM
BASE_MODELS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
               "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
MODEL_REGISTRY.update({base: MODEL_REGISTRY[causal] for base, causal in BASE_MODELS.items()})


def abstract_model(cfg: ModelConfig, dtype, formats: Mapping[str, str] | None = None,
                   grouped: frozenset[str] = frozenset()) -> nnx.Module:
    """The model with shapes only (no memory): the template weights are loaded into. `formats`:
    the path of each matrix kept quantized -> its format (`jaxserve_kernels.matmul.quant`); of those,
    `grouped` are kept grouped (`Quantizable.group`)."""
    family = MODEL_REGISTRY[cfg.architecture]

    def build():
        model = family.model(cfg, dtype, nnx.Rngs(0))
        modules = quantizable_modules(model)
        for path, fmt in (formats or {}).items():
            module_path, _, name = path.rpartition(".")
            module = modules.get(module_path)
            if module is None or name != module.WEIGHT:
                raise ValueError(f"{path} is not a matrix that can be kept quantized")
            module.quantize(fmt)
            if path in grouped:
                module.group()
        return model

    return nnx.eval_shape(build)


def quantizable_modules(model: nnx.Module) -> dict[str, Quantizable]:
    """Module path ("layers.0.mlp.up_proj") -> every module whose matrix may be kept quantized."""
    return {".".join(map(str, path)): node for path, node in nnx.iter_graph(model) if isinstance(node, Quantizable)}


# the layers a LoRA adapter may adapt (module paths): the attention's and the dense MLP's projections
ADAPTABLE = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]|mlp\.(gate|up|down))_proj")


def adaptable_modules(model: nnx.Module) -> dict[str, Linear]:
    """Module path -> every linear layer that takes a LoRA adapter (ADAPTABLE)."""
    return {path: module for path, module in quantizable_modules(model).items()
            if isinstance(module, Linear) and ADAPTABLE.fullmatch(path)}


def attach_adapters(model: nnx.Module, adapters: Mapping[str, tuple[jax.Array, jax.Array]]) -> None:
    """Give the layers of `adapters` (module path -> the slots' (A, B) stacks) their stacks, on a
    model merged for one trace: each then adds its rows' products (`lora.lora_delta`)."""
    modules = adaptable_modules(model)
    for path, stacks in adapters.items():
        modules[path].lora = nnx.data(stacks)


def forward(graphdef: nnx.GraphDef, state: nnx.State, kv: KVCache, inputs: ModelInputs,
            batch_invariant: bool = False, adapters: Mapping[str, tuple[jax.Array, jax.Array]] | None = None):
    """Pure form of the model for use under jit: (state, cache, inputs) -> (cache, f32[B, vocab]
    logits of each sequence's last token, [T, hidden] output at every token, or with `inputs.read_rows`
    at the rows read: see `head_logits`).
    `batch_invariant`: computed in tiles of a fixed number of rows (`invariant.py`), so that no
    row's numbers depend on the others'. `adapters`: the LoRA slots' stacks (`attach_adapters`),
    which the rows of `inputs.lora` use."""
    return forward_residual(graphdef, state, kv, inputs, batch_invariant, adapters)[:3]


def forward_residual(graphdef: nnx.GraphDef, state: nnx.State, kv: KVCache, inputs: ModelInputs,
                     batch_invariant: bool = False, adapters: Mapping[str, tuple[jax.Array, jax.Array]] | None = None,
                     steering: jax.Array | None = None, num_hidden: int = 0):
    """`forward`, with the rows' steering (`steering`: the slots' vectors, [L, S + 1, hidden]; each
    row's slot in `inputs.steer`) and the hidden states of `inputs.hidden_slots` gathered into
    `num_hidden` slots (`Decoder.run`) -> (cache, logits, output, [num_hidden, T, hidden] or None).
    Neither goes with `batch_invariant`."""
    model = nnx.merge(graphdef, state)
    attach_adapters(model, adapters or {})
    if steering is not None:
        model.steering = nnx.data(steering)
    if not batch_invariant:
        with live_rows(inputs.query_start[-1]):  # (the kernels' products skip the bucket's padding)
            kv, x, hidden = model.run(kv, inputs, num_hidden)
        with live_rows(inputs.num_samples):  # (a prompt step's LM head: one row of its 8 or more)
            logits = model.logits(x[inputs.logits_indices])
        return kv, logits, x, hidden
    kv, x = invariant.forward_in_tiles(model, kv, inputs)
    return kv, invariant.by_rows(model.logits, x[inputs.logits_indices], inputs.num_seqs), x, None


def head_logits(graphdef: nnx.GraphDef, state: nnx.State, hidden: jax.Array) -> jax.Array:
    """Pure form of the model's `logits`: rows of `forward`'s output -> f32[N, vocab] logits."""
    return nnx.merge(graphdef, state).logits(hidden)


__all__ = ["ADAPTABLE", "BASE_MODELS", "MODEL_REGISTRY", "KVCache", "LoraRows", "ModelFamily", "ModelInputs",
           "ModelOptions", "ReadRows", "abstract_model", "adaptable_modules", "attach_adapters", "forward",
           "forward_residual", "head_logits", "quantizable_modules", "rope_table"]
