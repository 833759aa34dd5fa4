"""The workers of an offline `LLMEngine` (vLLM's, for `collective_rpc`): one per data-parallel
replica, its `Engine` with the methods of a trainer's `worker_extension_cls` mixed in."""

from __future__ import annotations

from flax import nnx

from jaxserve.engine.core import Engine


class Worker:
    """What `collective_rpc` calls, one per data-parallel replica (vLLM's worker): the replica's
    `Engine` (its attributes read through: `self.config`, `self.runner`, ...), with the methods
    of `worker_extension_cls` mixed in."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def model(self):
        """The replica's model: its Flax NNX module with the weights it runs."""
        if self.engine.is_sleeping:
            raise RuntimeError("the LLM is asleep (its weights may be freed): call wake_up first")
        return nnx.merge(self.engine.runner.graphdef, self.engine.runner.state)
