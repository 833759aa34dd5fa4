"""`--kv-events-config` (vLLM's KVEventsConfig): where the prefix cache's KV events are published
for external routers (`jaxserve/engine/kv_events.py`)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.fields import config_object

PUBLISHERS = ("zmq", "null")


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # "null": events are made and dropped (vLLM's default where events are off)
    endpoint: str = "tcp://*:5557"  # bound where it holds "*" (or is ipc:// / inproc://), else connected to
    replay_endpoint: str | None = None  # a ROUTER socket that resends the batches from a sequence number on
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publishing thread
    topic: str = ""

    @classmethod
    def parse(cls, value: dict | str | None) -> KVEventsConfig | None:
        """From the JSON object (or its text) of `--kv-events-config`; None where events are off (or
        published nowhere: the "null" publisher).
        ValueError naming what is not supported."""
        value = config_object(value, "kv_events_config", [f.name for f in dataclasses.fields(cls)])
        if value is None:
            return None
        config = cls(**value)
        if config.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config: publisher must be one of {', '.join(PUBLISHERS)}, "
                             f"got {config.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
                raise ValueError(f"kv_events_config: {name} must be an integer >= 1, got {getattr(config, name)!r}")
        if not config.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv_events_config: endpoint must be tcp://, ipc:// or inproc://, got {config.endpoint!r}")
        return config if config.enable_kv_cache_events and config.publisher != "null" else None

    def endpoint_of(self, endpoint: str | None, replica: int) -> str | None:
        """Replica r's endpoint, as vLLM's data-parallel ranks have it: a tcp port plus r, an
        inproc name with "_dp{r}"."""
        if endpoint is None or replica == 0:
            return endpoint
        if endpoint.startswith("inproc://"):
            return f"{endpoint}_dp{replica}"
        if endpoint.startswith("tcp://"):
            base, _, port = endpoint.rpartition(":")
            return f"{base}:{int(port) + replica}"
        return f"{endpoint}_dp{replica}"
