"""vLLM's POST /start_profile and /stop_profile, served where profiling is on (`--profiler-config`,
or VLLM_TORCH_PROFILER_DIR): a trace of the server's process by JAX's profiler (`Profiler`)."""

from __future__ import annotations

import asyncio

from quart import Blueprint
from quart_schema import hide

from api.errors import APIError
from jaxserve.config.profiler import ProfilerConfig
from jaxserve.engine.profiling import Profiler

PATHS = ("/start_profile", "/stop_profile")  # (--api-key guards them)


def profiling_routes(config: ProfilerConfig) -> Blueprint:
    profiler = Profiler(config)
    routes = Blueprint("profiling", __name__)

    async def run(action) -> dict:
        try:
            await asyncio.to_thread(action)  # (writing a trace takes a while: not on the event loop)
        except ValueError as e:  # (one already running, or none; a directory it cannot write to)
            raise APIError(str(e)) from e
        return {}

    @routes.post("/start_profile")
    @hide
    async def start_profile():
        return await run(profiler.start)

    @routes.post("/stop_profile")
    @hide
    async def stop_profile():
        return await run(profiler.stop)

    return routes
