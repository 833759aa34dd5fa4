"""The model registry: each Hugging Face architecture name finds its family and options, and a
family's tables (HF name map, partition rules) fit the parameters of its models. Logits against
transformers, for every registered architecture, are tests/test_parity.py's."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import pytest
from flax import nnx
from safetensors import safe_open

from jaxserve.models import BASE_MODELS, LLAMA, MODEL_REGISTRY, MOE, abstract_model
from jaxserve.models.config import ModelConfig
from jaxserve.models.gemma import GemmaOptions
from jaxserve.models.llama import LlamaOptions
from jaxserve.models.moe import MoeOptions
from jaxserve.worker.weights import param_target

# hf_models.ARCHITECTURES name -> the options its config.json gives
OPTIONS = {
    "llama": LlamaOptions(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, sliding_window=None),
    "llama-linear-rope": LlamaOptions(qkv_bias=True, o_bias=True, mlp_bias=False, qk_norm=False, sliding_window=None),
    "llama3-rope": LlamaOptions(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, sliding_window=None),
    "mistral": LlamaOptions(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, sliding_window=24),
    "qwen2": LlamaOptions(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False, sliding_window=None),
    "qwen3": LlamaOptions(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True, sliding_window=None),
    "phi3": LlamaOptions(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, sliding_window=24),
    "mixtral": MoeOptions(qkv_bias=False, o_bias=False, qk_norm=False, sliding_window=24, num_experts_per_tok=2,
                          moe_intermediate_size=128, norm_topk_prob=True, shared_expert_intermediate_size=0,
                          dense_layers=()),
    "qwen2-moe": MoeOptions(qkv_bias=True, o_bias=False, qk_norm=False, sliding_window=None, num_experts_per_tok=2,
                            moe_intermediate_size=64, norm_topk_prob=False, shared_expert_intermediate_size=96,
                            dense_layers=(0,)),
    "qwen3-moe": MoeOptions(qkv_bias=False, o_bias=False, qk_norm=True, sliding_window=None, num_experts_per_tok=3,
                            moe_intermediate_size=64, norm_topk_prob=True, shared_expert_intermediate_size=0,
                            dense_layers=()),
    "gemma2": GemmaOptions(qk_norm=False, attention_bias=True, sm_scale=0.25, sliding_window=16,
                           local_layers=(True, False), local_rope=False, attn_soft_cap=4.0, final_soft_cap=8.0),
    "gemma3": GemmaOptions(qk_norm=True, attention_bias=False, sm_scale=32**-0.5, sliding_window=16,
                           local_layers=(True, False), local_rope=True, attn_soft_cap=None, final_soft_cap=8.0),
    "gemma3-vision": GemmaOptions(qk_norm=True, attention_bias=False, sm_scale=24**-0.5, sliding_window=16,
                                  local_layers=(False, True), local_rope=True, attn_soft_cap=None, final_soft_cap=None),
}


def test_every_registered_architecture_has_a_parity_model():
    """A registered architecture without a tiny model in tests/hf_models.py would go untested
    against transformers."""
    from hf_models import ARCHITECTURES

    assert set(OPTIONS) == set(ARCHITECTURES)
    # (a base model, an embedding checkpoint's, is its causal LM without the head: tests/test_embeddings.py)
    assert set(MODEL_REGISTRY) - set(BASE_MODELS) == {model_cls for _, model_cls, _ in ARCHITECTURES.values()}
    assert all(MODEL_REGISTRY[base] is MODEL_REGISTRY[causal] for base, causal in BASE_MODELS.items())
    assert all(MODEL_REGISTRY[a] is LLAMA for a in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                                    "Qwen3ForCausalLM"))
    assert all(MODEL_REGISTRY[a] is MOE for a in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_architecture_finds_its_family_and_options(name, hf_checkpoint):
    """config.json's architecture picks the family; its options shape the model (biases, q/k norms)."""
    model, model_dir = hf_checkpoint(name)
    cfg = ModelConfig.from_hf(model_dir)
    assert cfg.architecture == type(model).__name__ and cfg.options == OPTIONS[name]
    attn = nnx.state(abstract_model(cfg, jnp.float32))["layers"][0]["self_attn"]
    qkv_bias, o_bias = ((cfg.options.attention_bias,) * 2 if isinstance(cfg.options, GemmaOptions)
                        else (cfg.options.qkv_bias, cfg.options.o_bias))
    assert ("bias" in attn["q_proj"]) == qkv_bias and ("bias" in attn["o_proj"]) == o_bias
    assert ("q_norm" in attn) == ("k_norm" in attn) == cfg.options.qk_norm


def test_an_unknown_architecture_names_the_registered_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
    with pytest.raises(ValueError, match=r"unsupported architecture \['MambaForCausalLM'\].*supported: "
                                         + ", ".join(MODEL_REGISTRY)):
        ModelConfig.from_hf(tmp_path)


def test_the_first_registered_architecture_of_a_config_is_taken(hf_checkpoint, tmp_path):
    _, src = hf_checkpoint("qwen3")
    hf = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "architectures": ["Qwen3ForSequenceClassification", "Qwen3ForCausalLM"]}))
    assert ModelConfig.from_hf(tmp_path).architecture == "Qwen3ForCausalLM"


def _target(model_dir):
    cfg = ModelConfig.from_hf(model_dir)
    return MODEL_REGISTRY[cfg.architecture], param_target(cfg, nnx.state(abstract_model(cfg, jnp.float32)))


def test_name_maps_and_partition_rules_fit_the_family_parameters(hf_checkpoint, tmp_path):
    """Over the parity models: every HF tensor maps to a parameter of its model (an expert's to a slice
    of its layer's stack) and every entry of a family's name map is used; every partition rule
    (expert-parallel ones included) splits some parameter (of those models, or a Llama with MLP
    biases), and every projection, the embedding and the LM head are split by one.
    The tensors a family skips (an image-text checkpoint's vision tower) are those of no parameter."""
    _, llama_dir = hf_checkpoint("llama")
    hf = json.loads((llama_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "mlp_bias": True}))
    family, target = _target(tmp_path)
    paths = {family.name: set(target.shapes)}
    used_names, skipped = {}, set()
    for name in OPTIONS:
        _, model_dir = hf_checkpoint(name)
        family, target = _target(model_dir)
        paths.setdefault(family.name, set()).update(target.shapes)
        with safe_open(model_dir / "model.safetensors", framework="numpy") as f:
            for hf_name in f.keys():
                if family.skipped_tensors and re.fullmatch(family.skipped_tensors, hf_name):
                    skipped.add(hf_name.split(".")[0])
                    continue
                (pattern,) = [p for p in family.hf_name_map if re.fullmatch(p, hf_name)]
                used_names.setdefault(family.name, set()).add(pattern)
                path = re.sub(pattern, family.hf_name_map[pattern], hf_name)
                assert target.fits(path) or path in target.unused, (name, hf_name)
    assert skipped == {"vision_tower", "multi_modal_projector"}
    families = {family.name: family for family in MODEL_REGISTRY.values()}
    assert set(paths) == set(used_names) == set(families)
    for family in families.values():
        assert used_names[family.name] == set(family.hf_name_map)
        used_rules = set()
        # (over the families that share these rules: Phi-3 uses Llama's)
        sharing = set().union(*(paths[f.name] for f in families.values() if f.partition_rules is family.partition_rules))
        for rule_set in (family.partition_rules, family.expert_parallel_rules):
            for path in sharing:
                rules = [pattern for pattern, _, _ in rule_set if re.fullmatch(pattern, path)]
                assert len(rules) <= 1, path
                used_rules.update(rules)
                if rule_set is family.partition_rules:
                    assert rules or not re.search(r"_proj\.weight|embedding|lm_head", path), path
        assert used_rules == {pattern for pattern, _, _ in (*family.partition_rules, *family.expert_parallel_rules)}


def test_older_gemma_configs_give_the_same_model_config(hf_checkpoint, tmp_path):
    """config.json as transformers 4 wrote it (rope_theta, rope_scaling, rope_local_base_freq,
    sliding_window_pattern; Gemma 2 with no layer_types: alternating, even layers local) gives the
    ModelConfig of transformers 5's form (rope_parameters per layer type, layer_types)."""
    for name, old in (("gemma3", {"rope_theta": 1000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                  "rope_local_base_freq": 10000.0, "sliding_window_pattern": 2}),
                      ("gemma2", {"rope_theta": 10000.0})):
        _, model_dir = hf_checkpoint(name)
        hf = json.loads((model_dir / "config.json").read_text())
        older = {k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters")} | old
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(older))
        assert ModelConfig.from_hf(tmp_path / name) == ModelConfig.from_hf(model_dir)
    cfg = ModelConfig.from_hf(tmp_path / "gemma3")
    assert [(r.theta, r.type, r.factor) for r in cfg.ropes] == [(1000.0, "linear", 8.0), (10000.0, "default", 1.0)]


@pytest.mark.parametrize("change,message", [({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
                                            ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
                                            ({"layer_types": ["full_attention"]}, "layer_types must list 2")])
def test_what_gemma_cannot_run_is_an_error_naming_the_file(change, message, hf_checkpoint, tmp_path):
    _, model_dir = hf_checkpoint("gemma3")
    hf = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(hf | change))
    with pytest.raises(ValueError, match=f"{message}.*{tmp_path / 'config.json'}"):
        ModelConfig.from_hf(tmp_path)


def test_an_image_text_gemma_config_of_few_fields_takes_transformers_defaults(tmp_path):
    """Gemma 3's image-text checkpoints give little of their text model (gemma-3-4b-it's names its
    sizes, layer count, window and rope scaling): the rest is transformers' defaults, as its
    AutoConfig reads the same file."""
    import transformers

    text = {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "sliding_window": 1024,
            "model_type": "gemma3_text", "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model"}, "eos_token_id": [1, 106]}))
    cfg = ModelConfig.from_hf(tmp_path)
    want = transformers.AutoConfig.from_pretrained(tmp_path).get_text_config()
    assert (cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (
        want.vocab_size, want.num_attention_heads, want.num_key_value_heads, want.head_dim, want.rms_norm_eps, True)
    assert cfg.options.sm_scale == want.query_pre_attn_scalar ** -0.5 and cfg.options.sliding_window == 1024
    assert cfg.eos_token_ids == (1, 106) and sum(not local for local in cfg.options.local_layers) == 34 // 6


def test_phi3_configs_naming_longrope_su_or_yarn_read_as_transformers_reads_them(hf_checkpoint, tmp_path):
    _, model_dir = hf_checkpoint("phi3")
    hf = json.loads((model_dir / "config.json").read_text())
    assert ModelConfig.from_hf(model_dir).rope.type == "longrope"
    for name in ("su", "yarn"):
        rope = {k: v for k, v in hf["rope_parameters"].items() if k != "rope_type"} | {"type": name}
        (tmp_path / "config.json").write_text(json.dumps({**hf, "rope_parameters": None, "rope_scaling": rope}))
        assert ModelConfig.from_hf(tmp_path) == ModelConfig.from_hf(model_dir)
