"""vLLM's `EngineArgs`: an `LLM`'s or `LLMEngine`'s options, given as `LLM(model, **options)` takes
them or from a command line, and the `EngineConfig` they make."""

from __future__ import annotations

import argparse

from jaxserve.config import fields
from jaxserve.config.engine import EngineConfig
from jaxserve.config.profiler import profiler_config_from_env
from jaxserve.config.vllm import VLLM_OPTIONS, add_vllm_arguments


class EngineArgs:
    """vLLM's: the engine's options for `LLMEngine.from_engine_args`, as `LLM(model, **options)` takes
    them (attributes set afterwards count too); or from a command line (`add_cli_args`, `from_cli_args`)."""

    def __init__(self, model: str | None = None, **options):
        self.model = model
        vars(self).update(options)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """run_server.py's engine flags (EngineConfig's and vLLM's other engine options) on `parser`."""
        fields.add_arguments(parser.add_argument_group("engine"), EngineConfig)
        add_vllm_arguments(parser.add_argument_group("vLLM's engine options (taken where they change nothing here)"))
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = [f.name for f in fields.fields(EngineConfig) if f.metadata["setting"]["cli"]] + list(VLLM_OPTIONS)
        return cls(**{name: value for name in names if (value := getattr(args, name, None)) is not None})


def engine_config(model: str | None = None, **options) -> EngineConfig:
    """The configuration of `LLM(model, **options)` (`EngineConfig`'s fields under their names or
    vLLM's, vLLM's other options, `profiler_config` from VLLM_TORCH_PROFILER_DIR where not given)."""
    options.setdefault("profiler_config", profiler_config_from_env())
    return EngineConfig.from_options(model=model, **options)
