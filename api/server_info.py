"""The server's own routes: health (GET /health; vLLM's /ping, GET and POST), load (vLLM's
/load), Prometheus metrics (/metrics), the served models (/v1/models, /v1/models/<name>) and the
version (/version)."""

from __future__ import annotations

import importlib.metadata

from quart import Blueprint, Response

from api.generation import shutting_down
from api.limits import Limits, check_model
from api.response_models import EngineDown, ModelCard, ModelList, ModelPermission, ServerLoad, Version
from api.sse import new_id, now
from api.state import api_state
from jaxserve.config.lora import LoRARequest

server_info = Blueprint("server_info", __name__)


@server_info.get("/health")
@server_info.route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's health check)
async def health():
    """200 once requests are served; 503 while the engine warms up (requests sent meanwhile wait
    for it), while the server drains before stopping, or after the engine stopped."""
    state = api_state()
    engine = state.engine
    if engine.is_ready and not state.draining:
        return "", 200
    if state.draining and engine.is_running:  # (as every new request gets it: code, Retry-After)
        raise shutting_down()
    error = "engine not running" if not engine.is_running else "engine warming up: compiling its first step buckets"
    return EngineDown(error=error), 503


@server_info.get("/load")
async def load():
    """vLLM's: the requests being generated; and jaxserve's: those waiting to start, and their prompt tokens."""
    state = api_state()
    requests, tokens = state.engine.queued
    return ServerLoad(server_load=state.in_flight, queued_requests=requests, queued_tokens=tokens)


@server_info.get("/metrics")
async def prometheus():
    return Response(api_state().metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")


def model_card(name: str, limits: Limits) -> ModelCard:
    created = now()
    return ModelCard(id=name, created=created, root=limits.model_root or name, max_model_len=limits.max_model_len,
                     permission=[ModelPermission(id=new_id("modelperm"), created=created)])


def adapter_card(adapter: LoRARequest, limits: Limits) -> ModelCard:
    """A LoRA adapter's card, as vLLM's: `root` its files, `parent` the model it adapts."""
    card = model_card(adapter.lora_name, limits)
    return card.model_copy(update=dict(root=adapter.lora_path,
                                       parent=adapter.base_model_name or limits.served_model_name))


@server_info.get("/v1/models")
async def models():
    limits = api_state().limits
    cards = [model_card(name, limits) for name in limits.model_names]
    return ModelList(data=cards + [adapter_card(adapter, limits) for adapter in limits.adapters])


@server_info.get("/v1/models/<path:model>")
async def model(model: str):
    limits = api_state().limits
    check_model(model, limits)
    adapter = limits.adapters.get(model)
    return model_card(model, limits) if adapter is None else adapter_card(adapter, limits)


@server_info.get("/version")
async def version():
    return Version(version=importlib.metadata.version("jaxserve"))
