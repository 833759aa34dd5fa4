"""`--speculative-config` (vLLM's): which proposer drafts, how many tokens, and when speculation
steps aside."""

from __future__ import annotations

import dataclasses

from jaxserve.config.fields import config_object

# speculation runs in a step only while at most this many sequences run (unless the configuration
# says otherwise): past it the verification costs more than it saves (bench/RESULTS.md, speculative)
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


METHODS = ("ngram", "draft_model")


_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
           "model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config, as far as jaxserve runs it."""

    method: str
    num_speculative_tokens: int  # k: drafts per row and step
    prompt_lookup_max: int  # the longest suffix looked up (ngram)
    prompt_lookup_min: int  # the shortest
    disable_by_batch_size: int  # no drafts in a step while more sequences than this run
    model: str | None = None  # the draft model (draft_model): as --model takes it

    @classmethod
    def parse(cls, value: dict | str | None) -> SpeculativeConfig | None:
        """From the JSON object (or its text) of `--speculative-config`; None for none. ValueError for
        what jaxserve does not run, naming the field."""
        value = config_object(value, "speculative_config", _FIELDS)
        if value is None:
            return None
        model = value.get("model")
        method = value.get("method") or ("ngram" if model is None else "draft_model")
        if method in ("[ngram]",):
            method = "ngram"
        if method not in METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not supported (supported: "
                             f"{', '.join(METHODS)})")
        if (method == "draft_model") != (model is not None):
            raise ValueError("speculative_config: a draft model (method draft_model) needs \"model\", and only it"
                             if model is None or method == "draft_model" else
                             f"speculative_config: \"model\" is for the draft_model method, not {method}")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"speculative_config: model must be a model name or path, got {model!r}")
        lookup = [name for name in ("prompt_lookup_max", "prompt_lookup_min") if value.get(name) is not None]
        if model is not None and lookup:
            raise ValueError(f"speculative_config: {lookup[0]} is for the ngram method (a draft model drafts itself)")
        k = value.get("num_speculative_tokens")
        if not _is_int(k) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:  # (vLLM's defaults)
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _is_int(n) or n < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {n!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
        limit = value.get("disable_by_batch_size")
        if limit is None:
            limit = DEFAULT_DISABLE_BY_BATCH_SIZE
        if not _is_int(limit) or limit < 1:
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 1, got {limit!r}")
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_max=hi, prompt_lookup_min=lo,
                   disable_by_batch_size=limit, model=model)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
