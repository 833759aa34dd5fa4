"""LoRA adapters over HTTP, as vLLM serves them: the adapters a request may name as its `model`
(`api.limits.Adapters`: those of --lora-modules, and those loaded at run time), and vLLM's routes that load and
unload them (POST /v1/load_lora_adapter, /v1/unload_lora_adapter), which exist only where run-time
updates are allowed (--allow-runtime-lora-updating, or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).

An adapter is checked (its files read, its layers and rank against the model) on every replica
before it is named; unloading it makes new requests for it a 404 while those running finish.
"""

from __future__ import annotations

from quart import Blueprint, Response
from quart_schema import hide

from api.errors import APIError
from api.state import api_state, json_body

lora = Blueprint("lora", __name__)


def _text(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise APIError("Both 'lora_name' and 'lora_path' must be provided.", param=name)
    return value


@lora.post("/v1/load_lora_adapter")
@hide
async def load_lora_adapter():
    """vLLM's: {"lora_name", "lora_path", "load_inplace"}: a 400 for a name already loaded (unless
    `load_inplace`: the new files replace it) or for files that cannot be served."""
    state, body = api_state(), await json_body()
    name, path = _text(body, "lora_name"), _text(body, "lora_path")
    inplace = body.get("load_inplace", False)
    if not isinstance(inplace, bool):
        raise APIError(f"'load_inplace' must be a boolean, got {inplace!r}", param="load_inplace")
    adapters = state.limits.adapters
    if name in adapters and not inplace:
        raise APIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    if name in state.limits.model_names:
        raise APIError(f"'{name}' is the name of the served model", param="lora_name")
    request = adapters.new(name, path)
    try:
        await state.engine.on_every_replica("check_adapter", request)
    except ValueError as e:
        raise APIError(str(e), param="lora_path") from e
    adapters.put(request)
    return Response(f"Success: LoRA adapter '{name}' added successfully.", content_type="text/plain")


@lora.post("/v1/unload_lora_adapter")
@hide
async def unload_lora_adapter():
    """vLLM's: {"lora_name"} (its `lora_int_id` is not needed); a 404 for one not loaded."""
    state, body = api_state(), await json_body()
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise APIError("'lora_name' must be provided.", param="lora_name")
    if name not in state.limits.adapters:
        raise APIError(f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name",
                       code="lora_not_found")
    state.limits.adapters.remove(name)
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", content_type="text/plain")
