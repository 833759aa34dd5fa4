"""KV events for external routers (llm-d's precise prefix routing, NVIDIA Dynamo): the pages each
replica's prefix cache stores and evicts, and its resets, published over ZMQ in vLLM's format.

Each message is a multipart [topic, sequence number (8 bytes, big-endian), payload]; the payload
is vLLM's KVEventBatch in msgpack: an array [timestamp (s), [event, ...], data-parallel rank],
each event a map tagged by its "type" (as vLLM writes them since it moved from arrays to maps):

    {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | None,
     "token_ids": [...], "block_size": page_size, "lora_id": id | None, "medium": "GPU", "lora_name": name | None}
    {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

A block is a KV page. Its hash is `block_hash` of the prefix cache's key of the page (`page_hash`:
the chained sha256 of the pages before it and its own tokens; docs/deploy.md shows how a router
recomputes it from a prompt's tokens). A replica binds its own endpoint (vLLM's rule: the port plus
the replica's rank), and with `replay_endpoint` a ROUTER socket resends the kept batches from a
sequence number on, ending with sequence number -1, as vLLM's publisher does.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time

from jaxserve.config.kv_events import KVEventsConfig

log = logging.getLogger(__name__)

MEDIUM = "GPU"  # vLLM's name for the accelerator's memory, where routers expect it
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def block_hash(key: bytes) -> int:
    """The 64-bit block hash of a page key (its first 8 bytes, big-endian): routers key blocks by integers."""
    return int.from_bytes(key[:8], "big")


def event_map(event: tuple, page_size: int) -> dict:
    """One of the allocator's events (`PageAllocator.events`) as vLLM's event map."""
    kind = event[0]
    if kind == "stored":
        _, parent, keys, tokens, lora = event
        return {"type": "BlockStored", "block_hashes": [block_hash(k) for k in keys],
                "parent_block_hash": None if parent is None else block_hash(parent), "token_ids": tokens,
                "block_size": page_size, "lora_id": lora and lora.lora_int_id, "medium": MEDIUM,
                "lora_name": lora and lora.lora_name}
    if kind == "removed":
        return {"type": "BlockRemoved", "block_hashes": [block_hash(k) for k in event[1]], "medium": MEDIUM}
    return {"type": "AllBlocksCleared"}


class KVEventPublisher:
    """Publishes each step's events from a thread of its own (ZMQ sockets belong to one thread)."""

    def __init__(self, config: KVEventsConfig, replica: int, page_size: int):
        import msgpack
        import zmq

        self._zmq, self._pack = zmq, msgpack.Packer()
        self.config, self.replica, self.page_size = config, replica, page_size
        self.endpoint = config.endpoint_of(config.endpoint, replica)
        self.replay_endpoint = config.endpoint_of(config.replay_endpoint, replica)
        self._queue: queue.Queue = queue.Queue(config.max_queue_size)
        self._kept: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{replica}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise ValueError(f"kv_events_config: cannot open {self.endpoint}: {self._error}") from self._error
        self.publish([("cleared",)])  # (a replica that starts again holds none of the pages it held before)

    def publish(self, events: list[tuple]) -> None:
        """One batch of the allocator's events (nothing for none). Never blocks a step: with the
        queue full (a stalled publisher) the batch is dropped, and said so."""
        if not events:
            return
        batch = [time.time(), [event_map(e, self.page_size) for e in events], self.replica]
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            log.warning("the KV events queue is full (max_queue_size=%d): a batch of %d events is dropped",
                        self.config.max_queue_size, len(events))

    def close(self) -> None:
        with contextlib.suppress(queue.Full):  # (a full queue: its thread is stuck; it is a daemon)
            self._queue.put_nowait(None)
        self._thread.join(5)

    def _sockets(self):
        zmq = self._zmq
        context = zmq.Context.instance()
        pub = context.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        if "*" in self.endpoint or "::" in self.endpoint or not self.endpoint.startswith("tcp://"):
            pub.bind(self.endpoint)  # (vLLM's rule: a wildcard or a local transport is bound, else connected to)
        else:
            pub.connect(self.endpoint)
        replay = None
        if self.replay_endpoint is not None:
            replay = context.socket(zmq.ROUTER)
            replay.bind(self.replay_endpoint)
        return pub, replay

    def _run(self) -> None:
        try:
            pub, replay = self._sockets()
        except Exception as e:
            self._error = e
            self._started.set()
            return
        self._started.set()
        topic, number = self.config.topic.encode(), 0
        try:
            while True:
                pub.getsockopt(self._zmq.EVENTS)  # (takes in new subscribers now: a socket does only when used)
                if replay is not None and replay.poll(0):
                    self._replay(replay)
                try:
                    batch = self._queue.get(timeout=0.1)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                payload = self._pack.pack(batch)
                try:
                    pub.send_multipart((topic, number.to_bytes(8, "big"), payload))
                except Exception:  # (the events must not stop for one batch; a router can ask for a replay)
                    log.exception("publishing KV events batch %d failed", number)
                self._kept.append((number, payload))
                number += 1
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _replay(self, replay) -> None:
        """A client's [identity, "", first sequence number]: every kept batch from it on, then -1."""
        frames = replay.recv_multipart()
        if len(frames) != 3:
            log.warning("a KV events replay request of %d frames is ignored (3 expected)", len(frames))
            return
        client, _, first = frames
        start = int.from_bytes(first, "big")
        for number, payload in list(self._kept):
            if number >= start:
                replay.send_multipart((client, b"", number.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_OF_REPLAY, b""))
