"""`ModelConfig`: what the decoder needs to know about a checkpoint, read from its Hugging Face
`config.json` through the family's registry entry."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxserve.models import BASE_MODELS, MODEL_REGISTRY, ModelOptions
from jaxserve.models.rope import RopeConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    # the rotations layers use: [0] the model's, then any a family adds (`ModelFamily.ropes_from_hf`)
    ropes: tuple[RopeConfig, ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    options: ModelOptions  # the family's own settings (e.g. `llama.LlamaOptions`), from `MODEL_REGISTRY`
    eos_token_ids: tuple[int, ...]
    num_experts: int = 0  # experts of a Mixture-of-Experts layer (num_local_experts / num_experts); 0: dense
    # experts split whole over the mesh (`EngineConfig.enable_expert_parallel`, set by `parallel`), not
    # along their intermediate dimension
    expert_parallel: bool = False

    def for_context(self, max_model_len: int) -> ModelConfig:
        return dataclasses.replace(self, ropes=tuple(rope.for_context(max_model_len) for rope in self.ropes))

    @property
    def rope(self) -> RopeConfig:
        return self.ropes[0]

    @classmethod
    def from_hf(cls, model_dir: str | Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` for EOS ids)."""
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a model directory needs a Hugging Face config.json")
        hf = json.loads(path.read_text())
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in MODEL_REGISTRY), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.get('model_type')!r} in {path}; "
                f"supported: {', '.join(MODEL_REGISTRY)}"
            )
        family = MODEL_REGISTRY[arch]
        causal = BASE_MODELS.get(arch, arch)  # (a base model's settings are its causal LM's)
        text = family.decoder_config(causal, hf)  # (an image-text checkpoint's text model)
        num_heads = text["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_layers=text["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=text.get("num_key_value_heads") or num_heads,
            head_dim=text.get("head_dim") or text["hidden_size"] // num_heads,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            ropes=family.ropes_from_hf(causal, text, path),
            max_position_embeddings=text.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            options=family.options_from_hf(causal, text, path),
            eos_token_ids=_eos_ids(model_dir, text),
            num_experts=text.get("num_local_experts") or text.get("num_experts") or 0,
        )

    def parallel(self, enable_expert_parallel: bool, devices: int) -> ModelConfig:
        """This config as the engine runs it on a mesh of `devices`: with `enable_expert_parallel`,
        the experts split whole over the devices (`expert_parallel`), which needs a model with experts
        whose count divides over them."""
        if not enable_expert_parallel:
            return self
        if not self.num_experts or not MODEL_REGISTRY[self.architecture].expert_parallel_rules:
            raise ValueError(f"enable_expert_parallel: {self.architecture} has no experts to split; leave it off")
        if self.num_experts % devices:
            raise ValueError(f"enable_expert_parallel: the model's {self.num_experts} experts do not split evenly "
                             f"over tensor_parallel_size={devices} devices; choose a size that divides "
                             f"{self.num_experts}, or leave expert parallelism off")
        return dataclasses.replace(self, expert_parallel=True)


def _eos_ids(model_dir: Path, hf: dict) -> tuple[int, ...]:
    """All EOS ids of generation_config.json, else of config.json."""
    eos = None
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
    if eos is None:
        eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
