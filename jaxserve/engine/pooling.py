"""Embeddings from a decoder (`--runner pooling`, vLLM's): each prompt is prefilled through the same
scheduler and step as generation, the final norm's output gathered at the positions the pooling
reads (`return_hidden_states`), then pooled on the host. One token is sampled and dropped; the
sequence's pages are freed as it finishes.

The pooling: vLLM's `--pooler-config` (`pooling_type` LAST, MEAN or CLS, `normalize`), else the
checkpoint's sentence-transformers files (`modules.json`: its Pooling module's `config.json`, and a
Normalize module), else LAST, normalized (vLLM's default for decoder embedding models).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxserve.engine.outputs import HiddenStates
from jaxserve.errors import RequestError
from jaxserve.models import BASE_MODELS
from jaxserve.models.config import ModelConfig
from jaxserve.sample.params import SamplingParams

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' Pooling config: the mode each of its flags names
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


def is_pooling_checkpoint(model_dir: Path, model_config: ModelConfig) -> bool:
    """A base model's checkpoint (an HF `*Model` class: no LM head), or one with sentence-transformers' files."""
    return model_config.architecture in BASE_MODELS or (Path(model_dir) / "modules.json").is_file()


def pooler_config_of(model_dir: Path, given: dict | None) -> dict:
    """The pooling as --pooler-config gives it over the checkpoint's sentence-transformers files."""
    config = {"pooling_type": "LAST", "normalize": True}
    modules_file = Path(model_dir) / "modules.json"
    if modules_file.is_file():
        modules = json.loads(modules_file.read_text())
        config["normalize"] = any(m.get("type", "").endswith("Normalize") for m in modules)
        for module in modules:
            pooling = Path(model_dir) / module.get("path", "") / "config.json"
            if module.get("type", "").endswith("Pooling") and pooling.is_file():
                flags = json.loads(pooling.read_text())
                modes = [mode for flag, mode in _ST_MODES.items() if flags.get(flag)]
                if len(modes) != 1 or any(flags.get(f) for f in flags if f.startswith("pooling_mode_")
                                          and f not in _ST_MODES):
                    raise ValueError(f"{pooling}: one of {', '.join(_ST_MODES)} is supported, and only one")
                config["pooling_type"] = modes[0]
    unknown = set(given or {}) - {"pooling_type", "normalize"}
    if unknown:
        raise ValueError(f"pooler_config: {', '.join(sorted(unknown))} not supported (pooling_type, normalize)")
    config.update(given or {})
    config["pooling_type"] = str(config["pooling_type"]).upper()
    if config["pooling_type"] not in POOLING_TYPES or not isinstance(config["normalize"], bool):
        raise ValueError(f"pooler_config: pooling_type one of {', '.join(POOLING_TYPES)}, normalize a boolean; "
                         f"got {config}")
    return config


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """vLLM's, of an embedding request: `dimensions` keeps the first that many (Matryoshka embeddings,
    normalized after the cut), `normalize` overrides the pooler's."""

    dimensions: int | None = None
    normalize: bool | None = None

    def check(self, hidden_size: int) -> None:
        if self.dimensions is not None and not (isinstance(self.dimensions, int) and 1 <= self.dimensions
                                                <= hidden_size):
            raise RequestError(f"dimensions must be an integer from 1 to the model's {hidden_size}, got "
                               f"{self.dimensions!r}", "dimensions")


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """vLLM's: a prompt's embedding."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclasses.dataclass(frozen=True)
class Pooler:
    pooling_type: str = "LAST"
    normalize: bool = True

    @classmethod
    def of(cls, config) -> Pooler | None:
        """The pooling of a resolved `EngineConfig`; None where it generates."""
        return cls(**config.pooler_config) if config.runner == "pooling" else None

    def params(self) -> SamplingParams:
        """What a prompt to embed runs with: the final norm's output where the pooling reads it."""
        positions = "last" if self.pooling_type == "LAST" else "all"
        return SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False,
                              return_hidden_states={"layers": ["final"], "positions": positions})

    def pool(self, hidden: HiddenStates, params: PoolingParams | None = None) -> np.ndarray:
        """The embedding (f32[hidden], or its first `params.dimensions`) of a prompt's `hidden`."""
        params = params or PoolingParams()
        states = hidden.data[0].astype(np.float64)  # [positions, hidden]
        vector = {"LAST": lambda: states[-1], "MEAN": lambda: states.mean(0), "CLS": lambda: states[0]}[
            self.pooling_type]()[:params.dimensions]
        if self.normalize if params.normalize is None else params.normalize:
            vector = vector / max(np.linalg.norm(vector), 1e-12)
        return vector.astype(np.float32)


__all__ = ["POOLING_TYPES", "EmbeddingOutput", "EmbeddingRequestOutput", "Pooler", "PoolingParams",
           "is_pooling_checkpoint", "pooler_config_of"]
