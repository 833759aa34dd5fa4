"""What a request is checked against besides its own fields: the served model's names, context,
vocabulary and sampling defaults, and the server's options that shape requests and answers."""

from __future__ import annotations

import dataclasses
import itertools

from api.errors import APIError
from jaxserve.config.lora import LoRARequest
from jaxserve.engine.chat_template import CHAT_TEMPLATE_TIMEOUT_S
from jaxserve.engine.pooling import Pooler


class Adapters:
    """Adapter name -> its `LoRARequest`: each load gets an id of its own (an adapter loaded again
    under the same name shares no cached prefix with the one before)."""

    def __init__(self):
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self):
        return iter(list(self._by_name.values()))

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name)

    def new(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """A request for these files under a new id (named once `put`)."""
        return LoRARequest(name, next(self._ids), path, base_model_name)

    def put(self, request: LoRARequest) -> None:
        self._by_name[request.lora_name] = request

    def remove(self, name: str) -> None:
        del self._by_name[name]


@dataclasses.dataclass(frozen=True)
class Limits:
    served_model_name: str  # the name answers carry where a request names none
    max_model_len: int
    vocab_size: int
    # the model's sampling defaults (`Engine.sampling_defaults`): for the fields a request leaves out;
    # a default max_tokens also caps the request's own
    sampling_defaults: dict = dataclasses.field(default_factory=dict)
    trust_request_chat_template: bool = False  # vLLM's --trust-request-chat-template: requests may pass their own
    other_model_names: tuple[str, ...] = ()  # more names requests may use (vLLM's --served-model-name A B ...)
    chat_template_content_format: str = "auto"  # how message content reaches the template (CONTENT_FORMATS)
    model_root: str = ""  # where the model came from (--model), the model cards' `root` (vLLM's)
    tokens_as_ids: bool = False  # vLLM's --return-tokens-as-token-ids: the default of return_tokens_as_token_ids
    response_role: str = "assistant"  # vLLM's --response-role: the role of chat answers
    force_include_usage: bool = False  # vLLM's --enable-force-include-usage: usage ends every stream
    processor_args: frozenset[str] = frozenset()  # the logits processors' argument names (top-level fields too)
    chat_template_timeout: float = CHAT_TEMPLATE_TIMEOUT_S  # seconds a conversation may take to render
    # the LoRA adapters requests may name as their model (--lora-modules, and those loaded at run time)
    adapters: Adapters = dataclasses.field(default_factory=Adapters)
    pooler: Pooler | None = None  # --runner pooling: the embeddings' pooling (POST /v1/embeddings; no generation)
    hidden_size: int = 0  # the model's: the most `dimensions` an embedding request may ask for

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.served_model_name, *self.other_model_names


def check_model(model, limits: Limits) -> str:
    """404 unless `model` names a served model or LoRA adapter (or is None) -> the name the answer
    carries: its own, as vLLM answers, or the first served name."""
    if model is not None and not isinstance(model, str):
        raise APIError("'model' must be a string", param="model")
    if model is not None and model not in limits.model_names and model not in limits.adapters:
        names = [*limits.model_names, *(adapter.lora_name for adapter in limits.adapters)]
        raise APIError(f"The model '{model}' does not exist; this server serves "
                       f"{', '.join(repr(name) for name in names)}", status=404, param="model",
                       code="model_not_found")
    return limits.served_model_name if model is None else model
