"""When the next step is planned: each bucket's device time measured on the steps the runner waited
for (`StepClock`, on a clock the test sets), and the server's engine loop asking for that time
before it takes the requests sent meanwhile."""

from __future__ import annotations

import threading
import time

import pytest
from server import MODEL

from jaxserve.worker import clock as clock_module
from jaxserve.worker.clock import EARLY, StepClock

S, L = (16, 8, 4), (64, 8, 4)  # two step buckets


class Now:
    t = 0.0

    def monotonic(self) -> float:
        return self.t


@pytest.fixture
def now(monkeypatch):
    fake = Now()
    monkeypatch.setattr(clock_module, "time", fake)
    return fake


def test_a_bucket_is_timed_from_when_the_device_was_free_for_it_to_the_end_of_a_fetch_that_waited(now):
    clock, a, b, c = StepClock(), object(), object(), object()
    clock.planning()
    now.t = 0.002
    clock.launched(a, S)
    assert clock.lead == pytest.approx(0.002) and clock.plan_at() is None  # (S not timed yet)
    now.t = 0.040
    clock.collected(a, fetch_from=0.003)
    assert clock.costs == {S: pytest.approx(0.038)} and clock.plan_at() is None  # (nothing in flight)
    now.t = 0.041
    clock.launched(b, S)  # after the device was free: it starts at its launch
    assert clock.plan_at() == pytest.approx(0.041 + (1 - EARLY) * 0.038 - 0.002)
    now.t = 0.070
    clock.launched(c, S)  # behind b: it starts when b ends
    now.t = 0.081
    clock.collected(b, fetch_from=0.071)
    assert clock.costs[S] == pytest.approx(0.038 + 0.25 * (0.040 - 0.038))
    assert clock.plan_at() == pytest.approx(0.081 + (1 - EARLY) * clock.costs[S] - 0.002)


def test_a_step_done_before_its_fetch_is_not_timed_and_the_next_starts_no_later_than_that_fetch(now):
    clock, a, b = StepClock(), object(), object()
    clock.costs[L] = 0.1
    clock.launched(a, S)
    now.t = 0.050
    clock.launched(b, L)
    now.t = 0.060
    clock.collected(a, fetch_from=0.060)  # its outputs were there already
    assert S not in clock.costs
    assert clock.plan_at() == pytest.approx(0.060 + (1 - EARLY) * 0.1)


def test_a_step_never_collected_is_forgotten_and_a_plan_waiting_on_a_step_measures_no_lead(now):
    clock, failed, a, b = StepClock(), object(), object(), object()
    clock.launched(failed, S)
    clock.launched(a, S)
    now.t = 0.030
    clock.collected(a, fetch_from=0.001)
    assert clock.plan_at() is None and clock.costs[S] == pytest.approx(0.030)
    now.t = 0.031
    clock.launched(b, S)
    clock.planning()
    now.t = 0.060
    clock.collected(b, fetch_from=0.040)  # (the planning waited for b: no measure of the lead)
    now.t = 0.061
    clock.launched(a, S)
    cost = clock.costs[S]
    assert clock.lead is None and clock.plan_at() == pytest.approx(0.061 + (1 - EARLY) * cost)


def test_a_request_sent_while_the_engine_waits_to_plan_joins_the_next_step(served, client, monkeypatch):
    """The loop asks the clock when to plan before it takes the requests sent meanwhile: here the
    clock answers only once a second request is queued, which the next step then holds."""
    async_engine = served[1]
    runner = async_engine.engine.runner
    launched, launch, plan_at = [], runner.launch, runner.clock.plan_at
    asked, go = threading.Event(), threading.Event()

    def recording(batch):
        launched.append({row.seed for row in batch.rows})
        return launch(batch)

    def held():
        if launched and not go.is_set() and not asked.is_set():  # (the first's steps in flight)
            asked.set()
            assert go.wait(60)
        return plan_at()

    monkeypatch.setattr(runner, "launch", recording)
    monkeypatch.setattr(runner.clock, "plan_at", held)

    def complete(seed: int, max_tokens: int) -> None:
        client.completions.create(model=MODEL, prompt="hello there", max_tokens=max_tokens, seed=seed,
                                  temperature=1.0, extra_body={"ignore_eos": True})

    first = threading.Thread(target=complete, args=(101, 24))
    second = threading.Thread(target=complete, args=(202, 2))
    try:
        first.start()
        assert asked.wait(60)
        before = len(launched)
        second.start()
        deadline = time.monotonic() + 60
        while async_engine._commands.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        go.set()
        first.join(60)
        second.join(60)
    assert 101 in launched[before - 1] and 202 in launched[before]
