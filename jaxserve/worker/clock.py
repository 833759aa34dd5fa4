"""When the step in flight should end: each step bucket's device time, measured on the steps the
runner waited for, so that the server's engine loop can plan the next step just before the device
is free (`AsyncEngine`) instead of as soon as it can.

A step planned while the one before still computes waits behind it on the device, and a request
that arrives after it was planned waits for both. Planned late, the step takes the requests that
arrived meanwhile: under a stream of arrivals their first tokens come a whole step sooner. Planned
too late, the device idles, so the time aimed at is early by the planning's own measured time
(`lead`) and a share of the step's."""

from __future__ import annotations

import time

WAITED_S = 2e-4  # a fetch that took longer waited for the device: the step ended as it returned
EARLY = 0.1  # the share of a step's expected time by which its successor is planned early
SMOOTHING = 0.25  # the weight of a new measurement in a bucket's (and the lead's) moving average


class StepClock:
    def __init__(self):
        self.costs: dict[tuple, float] = {}  # step bucket -> its device time (s), a moving average
        self.lead: float | None = None  # from the planning's start to the step's launch (s), a moving average
        self._launched: dict[int, tuple] = {}  # id of a launched step not collected -> (bucket, when), oldest first
        self._free_at = 0.0  # when the device finished the last step collected (or a later bound)
        self._planning_from: float | None = None

    def planning(self) -> None:
        """The next step's planning starts now (its time to the launch is measured as the lead)."""
        self._planning_from = time.monotonic()

    def launched(self, step: object, shape: tuple) -> None:
        now = time.monotonic()
        self._launched.pop(id(step), None)  # (an id of a step gone, reused: the new one is the newest)
        self._launched[id(step)] = (shape, now)
        if self._planning_from is not None:
            self.lead = _average(self.lead, now - self._planning_from)
            self._planning_from = None

    def collected(self, step: object, fetch_from: float) -> None:
        """A launched step has its outputs on the host; fetching them started at `fetch_from`. Its
        device time is measured where the fetch waited for it: from when the device was free for it
        (the step before ended, or it was launched) to now; else it ended by `fetch_from`. (Steps
        launched before it and never collected, those of a failed step, are forgotten.)"""
        now = time.monotonic()
        while self._launched:
            key, (shape, launched_at) = next(iter(self._launched.items()))
            del self._launched[key]
            if key == id(step):
                break
        else:
            return
        self._planning_from = None  # (a planning that waited for a step is no measure of the lead)
        start, cost = max(self._free_at, launched_at), self.costs.get(shape)
        if now - fetch_from >= WAITED_S:
            self.costs[shape], self._free_at = _average(cost, now - start), now
            return
        # done before asked: it took no longer than until the fetch, which bounds a cost planned
        # past (the next plan is then earlier, so that its fetch waits and times it)
        if cost is not None and fetch_from - start < cost:
            self.costs[shape] = _average(cost, fetch_from - start)
        self._free_at = fetch_from

    def plan_at(self) -> float | None:
        """When to start planning the next step (time.monotonic()): before the newest step launched
        is expected to end by the lead and a share of its time. None without a step in flight, or
        where its bucket has not been measured yet. (Where another launched step is ahead of it, the
        time is early: planning early costs nothing but the wait for those arriving after.)"""
        if not self._launched:
            return None
        shape, launched_at = next(reversed(self._launched.values()))
        cost = self.costs.get(shape)
        if cost is None:
            return None
        return max(self._free_at, launched_at) + (1 - EARLY) * cost - (self.lead or 0.0)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)
