"""A trainer's routes (docs/rl.md), vLLM's names where it has them (SGLang's otherwise): pause and
resume generation, new weights from a checkpoint path or streamed as tensors, their version,
sleep and wake, and the prefix cache's reset. They act on every replica at once.

New weights streamed: POST /start_weight_update, then POST /update_weights once or more, each body
a safetensors file's bytes (any tensors, by Hugging Face name or parameter path; chunked transfer
is fine, and no body limit applies), then POST /finish_weight_update swaps them all in at once. A
POST /update_weights with no update started is all three in one.

They are left out of /openapi.json (as vLLM shows them only in its development mode): they are a
trainer's controls of the server, not the API its clients call.
"""

from __future__ import annotations

import asyncio

from quart import Blueprint, Request, request
from quart_schema import hide

from api import tokens_io
from api.errors import APIError
from api.state import api_state, json_body
from checkpoints.stream import SafetensorsStream
from jaxserve.worker.weight_update import StagedWeights

training = Blueprint("training", __name__)
# the routes --api-key guards, beside /v1's
PATHS = ("/pause", "/resume", "/is_paused", "/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache",
         "/release_kv_cache_memory", "/abort_requests", "/start_weight_update", "/update_weights",
         "/finish_weight_update", "/update_weights_from_disk", "/get_weight_version", "/weight_info",
         "/get_world_size")


class UnboundedWeights(Request):
    """Quart's request, with no body limit (--max-request-body-bytes) where weights are streamed in:
    Quart sets a body's limit as it makes the request, before any route runs."""

    def __init__(self, method: str, scheme: str, path: str, *args, max_content_length: int | None = None, **kwargs):
        if path == "/update_weights":
            max_content_length = None
        super().__init__(method, scheme, path, *args, max_content_length=max_content_length, **kwargs)


def _flag(name: str, default: bool) -> bool:
    value = request.args.get(name)
    if value is None:
        return default
    if value.lower() not in ("true", "false", "1", "0"):
        raise APIError(f"'{name}' must be true or false, not {value!r}", param=name)
    return value.lower() in ("true", "1")


async def _on_every_replica(method: str, *args) -> list:
    """A control of every replica; its refusal (a ValueError) is a 400."""
    try:
        return await api_state().engine.on_every_replica(method, *args)
    except (ValueError, FileNotFoundError) as e:
        raise APIError(str(e)) from e


@training.post("/pause")
@hide
async def pause():
    """vLLM's: ?mode=abort (default) | wait | keep, ?clear_cache=true (default); its older
    ?wait_for_inflight_requests=true is mode=wait."""
    mode = "wait" if _flag("wait_for_inflight_requests", False) else request.args.get("mode", "abort")
    await _on_every_replica("pause", mode, _flag("clear_cache", True))
    return {"status": "paused"}


@training.post("/resume")
@hide
async def resume():
    await _on_every_replica("resume")
    return {"status": "resumed"}


@training.get("/is_paused")
@hide
async def is_paused():
    return {"is_paused": any(await _on_every_replica("is_paused"))}


@training.post("/sleep")
@hide
async def sleep():
    """vLLM's: ?level=0 pauses (requests wait), 1 also frees the KV cache and keeps the weights on the
    host (the default), 2 frees both; ?mode=abort (default) | wait | keep, as /pause's."""
    level = request.args.get("level", "1")
    if level not in ("0", "1", "2"):
        raise APIError(f"'level' must be 0, 1 or 2, not {level!r}", param="level")
    await _on_every_replica("sleep", int(level), request.args.get("mode", "abort"))
    return {"status": "sleeping", "level": int(level)}


@training.post("/release_kv_cache_memory")
@hide
async def release_kv_cache_memory():
    """vLLM's: after /sleep?level=0 (or /pause), free the KV cache until /wake_up?tags=kv_cache."""
    await _on_every_replica("release_kv_cache_memory")
    return {"status": "kv_cache_released"}


@training.post("/wake_up")
@hide
async def wake_up():
    """vLLM's: ?tags=weights&tags=kv_cache&tags=scheduling (default: all); once all is awake, the
    engine resumes."""
    tags = request.args.getlist("tags") or None
    awake = all(await _on_every_replica("wake_up", tags))
    return {"status": "awake" if awake else "sleeping", "tags": tags}


@training.get("/is_sleeping")
@hide
async def is_sleeping():
    """vLLM's: paused (/sleep at any level, or /pause) or memory freed."""
    return {"is_sleeping": any(await _on_every_replica("is_sleeping"))}


@training.post("/reset_prefix_cache")
@hide
async def reset_prefix_cache():
    """vLLM's: forget the prefix cache's pages (false, and nothing forgotten, while requests run, unless
    ?reset_running_requests=true: they drop their KV first, to recompute it); ?reset_external=true
    has no KV connector to reset here."""
    flags = _flag("reset_running_requests", False), _flag("reset_external", False)
    return {"success": all(await _on_every_replica("reset_prefix_cache", *flags))}


@training.post("/abort_requests")
@hide
async def abort_requests():
    """vLLM's: end requests in flight without pausing, {"request_ids": [...]} (a response's id, or the
    request_id given to /inference/v1/generate; none: every request): each answers, finish reason
    "abort"."""
    aborted = tokens_io.abort_requests(api_state(), (await json_body()).get("request_ids"))
    return {"status": "aborted", "aborted": aborted}


@training.get("/get_weight_version")
@hide
async def get_weight_version():
    return {"weight_version": api_state().engine.weight_version}


@training.get("/weight_info")
@hide
async def weight_info():
    """vLLM's name of /get_weight_version."""
    return await get_weight_version()


@training.get("/get_world_size")
@hide
async def get_world_size():
    """vLLM's: the devices serving, all replicas' (?include_dp=false: one replica's)."""
    config = api_state().engine.engine.config
    replicas = len(api_state().engine.replicas) if _flag("include_dp", True) else 1
    return {"world_size": config.tensor_parallel_size * replicas}


def _version_field(body: dict) -> int | None:
    version = body.get("weight_version")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
        raise APIError("'weight_version' must be a non-negative integer", param="weight_version")
    return version


@training.post("/update_weights_from_disk")
@hide
async def update_weights_from_disk():
    """SGLang's: {"model_path": a checkpoint of the model's architecture and shapes (safetensors
    directory, Orbax copy, GGUF file), "weight_version": optional}."""
    body = await json_body()
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise APIError("'model_path' (a checkpoint's path on the server) is required", param="model_path")
    engine = api_state().engine
    version = engine.next_version(_version_field(body))
    await _on_every_replica("update_weights_from_path", path, version)
    return {"success": True, "message": f"weights loaded from {path}", "weight_version": version}


@training.post("/start_weight_update")
@hide
async def start_weight_update():
    """Begin a streamed update: {"weight_version": optional} (default: one more than now). One under
    way is dropped."""
    version = _version_field(await json_body() if await request.get_data() else {})
    state = api_state()
    async with state.weights_lock:
        state.staged_weights, state.staged_version = _staging(), version
    return {"status": "started"}


def _staging() -> list[StagedWeights]:
    """An update's tensors so far, one set per replica."""
    try:
        engines = api_state().engine.local_engines()
    except ValueError as e:
        raise APIError(str(e)) from e
    return [StagedWeights(engine.weight_layout) for engine in engines]


@training.post("/update_weights")
@hide
async def update_weights():
    """Tensors of a streamed update (the body is a safetensors file's bytes); with no update under way,
    a whole update of its own (?weight_version=N: its version)."""
    state = api_state()
    async with state.weights_lock:  # (one upload at a time: an update's parts never mix with another's)
        staged = state.staged_weights
        if staged is None:
            version, staged = _int_arg("weight_version"), _staging()
            await _receive(staged)
            return await _swap(staged, version)
        try:
            count = await _receive(staged)
        except BaseException:  # (a broken or abandoned part: the update is dropped whole)
            state.staged_weights = None
            raise
        return {"status": "received", "tensors": count}


async def _receive(staged: list[StagedWeights]) -> int:
    """The request body's tensors into `staged` -> how many."""
    stream, count = SafetensorsStream(), 0
    try:
        async for chunk in request.body:
            for name, array in stream.feed(chunk):
                await asyncio.to_thread(_put, staged, name, array)
                count += 1
        stream.finish()
    except ValueError as e:
        raise APIError(f"the update is dropped: {e}") from e
    return count


def _int_arg(name: str) -> int | None:
    value = request.args.get(name)
    if value is None:
        return None
    if not value.isdigit():
        raise APIError(f"'{name}' must be a non-negative integer", param=name)
    return int(value)


def _put(staged: list[StagedWeights], name: str, array) -> None:
    for replica in staged:
        replica.put(name, array)


@training.post("/finish_weight_update")
@hide
async def finish_weight_update():
    """Swap the tensors sent in at once (all of the model's must have come) -> the new version."""
    state = api_state()
    async with state.weights_lock:
        staged, state.staged_weights = state.staged_weights, None
        if staged is None:
            raise APIError("no weight update is under way: POST /start_weight_update first")
        return await _swap(staged, state.staged_version)


async def _swap(staged: list[StagedWeights], version: int | None) -> dict:
    """Every replica's new weights checked whole, then swapped in on each."""
    engine = api_state().engine
    try:
        leaves = [replica.leaves() for replica in staged]
    except ValueError as e:
        raise APIError(f"the update is dropped: {e}") from e
    version = engine.next_version(version)
    await asyncio.gather(*(replica.update_weights(each, version) for replica, each in zip(engine.replicas, leaves)))
    return {"success": True, "weight_version": version}
