"""`--profiler-config` (vLLM's ProfilerConfig), or vLLM's older `VLLM_TORCH_PROFILER_DIR`: where
the traces of `start_profile` / `stop_profile` go (`jaxserve/engine/profiling.py`)."""

from __future__ import annotations

import dataclasses
import os

from jaxserve.config.fields import config_object

PROFILERS = ("torch", "jax")  # vLLM's "torch" is taken as JAX's profiler: the trace its users ask for
DIR_ENV = "VLLM_TORCH_PROFILER_DIR"


def profiler_config_from_env() -> dict | None:
    """vLLM's older switch, VLLM_TORCH_PROFILER_DIR, as the --profiler-config it stands for (read where
    the settings come in: run_server.py's flags, LLM's keywords)."""
    directory = os.environ.get(DIR_ENV)
    return {"profiler": "torch", "torch_profiler_dir": directory} if directory else None


@dataclasses.dataclass(frozen=True)
class ProfilerConfig:
    directory: str

    @classmethod
    def parse(cls, value: dict | str | None) -> ProfilerConfig | None:
        """From the JSON object (or its text) of `--profiler-config`: {"profiler": "torch" (or "jax"),
        "torch_profiler_dir": DIR}; None: profiling off. ValueError naming what is not supported."""
        value = config_object(value, "profiler_config", ["profiler", "torch_profiler_dir"]) or {}
        profiler, directory = value.get("profiler"), value.get("torch_profiler_dir")
        if profiler is None:
            if directory is not None:
                raise ValueError("profiler_config: torch_profiler_dir is for a profiler: add \"profiler\": \"torch\"")
            return None
        if profiler not in PROFILERS:
            raise ValueError(f"profiler_config: profiler must be one of {', '.join(PROFILERS)} (JAX's profiler traces "
                             f"every device, CUDA's included), got {profiler!r}")
        if not directory or not isinstance(directory, str):
            raise ValueError("profiler_config: torch_profiler_dir must name the directory the traces go to")
        return cls(os.path.abspath(os.path.expanduser(directory)))
