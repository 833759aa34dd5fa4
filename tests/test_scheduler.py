"""Continuous batching: the plan (host only, fake device outputs) and the engine under churn."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CROWDED_ENGINE

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.sample.tensors import PromptLogprobs
from jaxserve.sched.plan import ScheduledBatch, StepOutput, prompt_targets
from jaxserve.sched.scheduler import Scheduler
from jaxserve.sched.sequence import Sequence
from jaxserve.structured_output.grammar import Constraint

EOS = 99


def make_scheduler(**kwargs) -> Scheduler:
    cfg = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, page_size=4, num_pages=33)
    return Scheduler(EngineConfig(**{**cfg, **kwargs}), eos_token_ids=(EOS,))


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 8, **params) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", prompt_token_ids=list(range(1, prompt_len + 1)),
                    params=SamplingParams(max_tokens=max_tokens, **params), seed=0, max_tokens=max_tokens)


def outputs(tokens: list[int], batch: ScheduledBatch | None = None) -> StepOutput:
    """Fake device outputs; with `batch`, the prompt logprobs it asks for too: each minus its token's position."""
    n = len(tokens)
    prompt = None
    if batch is not None:
        positions = np.asarray([row.start_position + i for row in batch.rows for i in range(len(prompt_targets(row)))])
        prompt = PromptLogprobs(logprobs=-positions.astype(np.float32), ranks=np.ones(len(positions), np.int32),
                                top_ids=np.zeros((len(positions), 1), np.int32),
                                top_logprobs=np.zeros((len(positions), 1), np.float32))
    return StepOutput(token_ids=np.asarray(tokens, np.int32), logprobs=np.zeros(n, np.float32),
                      ranks=np.ones(n, np.int32), top_ids=np.asarray(tokens, np.int32)[:, None],
                      top_logprobs=np.zeros((n, 1), np.float32), entropies=np.zeros(n, np.float32), prompt=prompt)


def run_step(sched: Scheduler, token: int = 7):
    batch = sched.schedule()
    sched.update(batch, outputs([token] * len(batch.rows), batch))
    return batch


def test_the_next_step_is_planned_before_the_sampled_tokens_are_known():
    sched = make_scheduler()
    for i in range(3):
        sched.add(make_seq(i, 3, max_tokens=2))
    first = sched.schedule()  # three prefills, each sampling
    second = sched.schedule()  # planned while the first computes: each row's input is pending
    assert [(r.seq_id, r.token_ids, r.start_position, r.pending_row, r.sample) for r in second.rows] == [
        (0, [0], 3, 0, True), (1, [0], 3, 1, True), (2, [0], 3, 2, True)]
    assert sched.can_schedule_ahead(second)
    # max_tokens=2: the second step's tokens are the last; nothing more is planned before they are known
    assert sched.schedule().rows == []
    sched.update(first, outputs([EOS, 5, 6]))  # seq 0 ends: its row of the second step is dropped
    assert 0 not in sched.seqs
    assert [s.token_ids[3:] for s in (sched.seqs[1], sched.seqs[2])] == [[5], [6]]
    assert sched.seqs[1].num_pending == 1 and sched.seqs[1].num_computed_tokens == 4
    third = sched.schedule()
    assert third.rows == []  # both are waiting for their last token
    changed = sched.update(second, outputs([EOS, 8, 9]))
    assert [(s.seq_id, s.output_token_ids, s.finish_reason) for s in changed] == [
        (1, [5, 8], "length"), (2, [6, 9], "length")]
    assert not sched.has_unfinished() and sched.allocator.num_free == sched.allocator.num_usable


def test_a_sequence_preempted_with_a_pending_token_recomputes_it():
    sched = make_scheduler(num_pages=5)  # 4 usable pages of 4 tokens
    sched.add(make_seq(0, 8, max_tokens=8))
    sched.add(make_seq(1, 7, max_tokens=8))
    first = sched.schedule()  # both prefill and sample
    second = sched.schedule()  # seq 0's pending token needs a third page: seq 1 gives its pages back
    assert second.preempted == [1] and [(r.seq_id, r.pending_row) for r in second.rows] == [(0, 0)]
    seq1 = sched.seqs[1]
    assert (seq1.num_computed_tokens, seq1.num_pending, seq1.page_ids) == (0, 0, [])
    sched.update(first, outputs([3, 4]))  # seq 1's sampled token is dropped: it samples that position again
    assert seq1.num_tokens == 7 and sched.seqs[0].output_token_ids == [3]
    sched.update(second, outputs([5]))
    assert sched.seqs[0].output_token_ids == [3, 5]


def test_a_sequence_that_arrives_before_a_planned_step_is_launched_joins_it():
    """`admit`: within the plan's token budget (here 16: 2 decode rows and a 14-token prompt chunk),
    its samples numbered after the rows already there; never into a plan that preempted."""
    sched = make_scheduler()
    for i in range(2):
        sched.add(make_seq(i, 3))
    first = sched.schedule()
    second = sched.schedule()  # planned ahead; then seq 2 arrives
    sched.add(make_seq(2, 20))
    assert sched.admit(second) == 1
    assert [(r.seq_id, len(r.token_ids), r.pending_row, r.sample, r.draft_slot) for r in second.rows] == [
        (0, 1, 0, True, 3), (1, 1, 1, True, 3), (2, 14, -1, False, 3)]
    assert second.num_tokens == 16 and sched.seqs[2].num_computed_tokens == 14
    sched.add(make_seq(3, 2))
    assert sched.admit(second) == 0  # (no budget left)
    sched.update(first, outputs([5, 6]))
    sched.update(second, outputs([8, 9, 0]))
    assert [sched.seqs[i].output_token_ids for i in range(3)] == [[5, 8], [6, 9], []]
    third = sched.schedule()
    assert [(r.seq_id, len(r.token_ids)) for r in third.rows] == [(0, 1), (1, 1), (2, 6), (3, 2)]
    crowded = make_scheduler(num_pages=3)  # 2 usable pages: the second sequence's next token preempts it
    crowded.add(make_seq(0, 4)), crowded.add(make_seq(1, 4))
    crowded.update(crowded.schedule(), outputs([5, 6]))
    planned = crowded.schedule()
    crowded.add(make_seq(2, 1))
    assert planned.preempted == [1] and crowded.admit(planned) == 0


def test_a_sequence_admitted_into_a_plan_cut_to_a_bucket_stays_out_of_its_cut():
    """A plan cut to the bucket below (`bucket_cut`) admits nothing past the cut: its `token_limit`."""
    sched = make_scheduler(max_model_len=512, max_num_seqs=64, max_num_batched_tokens=512, page_size=16,
                           num_pages=200, enable_prefix_caching=False, padding_computed_from=0)
    for i in range(9):
        sched.add(make_seq(i, 2, max_tokens=50))
    run_step(sched)
    sched.add(make_seq(9, 128)), sched.add(make_seq(10, 128))
    batch = sched.schedule()  # 9 + 256 tokens, cut to 256
    sched.add(make_seq(11, 8))
    assert sched.admit(batch) == 0 and batch.num_tokens == batch.token_limit == 256


def test_penalties_are_planned_ahead_and_grammars_are_not():
    sched = make_scheduler()
    sched.add(make_seq(0, 3, presence_penalty=0.5))  # the device puts its pending token into the history
    assert sched.can_schedule_ahead(sched.schedule())
    sched.add(make_seq(1, 3, constraint=Constraint("choice", ("yes", "no"))))
    batch = sched.schedule()
    assert [r.seq_id for r in batch.rows if r.sample] == [0, 1] and not sched.can_schedule_ahead(batch)


def test_a_smaller_token_budget_caps_each_plan_and_every_sequence_still_finishes():
    """While the larger step buckets compile in the background, the engine passes a smaller budget
    (`Runner.token_budget`); a larger one than max_num_batched_tokens changes nothing."""
    sched = make_scheduler()
    sched.add(make_seq(0, 10, max_tokens=3))
    sched.add(make_seq(1, 2, max_tokens=3))
    batch = sched.schedule(token_budget=4)
    assert batch.num_tokens == 4 and [(r.seq_id, len(r.token_ids)) for r in batch.rows] == [(0, 4)]
    sched.update(batch, outputs([7]))
    while sched.has_unfinished():
        batch = sched.schedule(token_budget=1)
        assert batch.num_tokens == len(batch.rows) == 1
        sched.update(batch, outputs([7]))
    assert sched.finish_counts["length"] == 2
    sched.add(make_seq(2, 40))
    assert sched.schedule(token_budget=1000).num_tokens == 16


def test_prefill_is_chunked_under_the_token_budget_while_decodes_continue():
    sched = make_scheduler()
    sched.add(make_seq(0, 3))
    run_step(sched)  # prefill of seq 0, samples its first token
    sched.add(make_seq(1, 40))
    batch = run_step(sched)
    assert [(r.seq_id, len(r.token_ids), r.sample) for r in batch.rows] == [(0, 1, True), (1, 15, False)]
    assert batch.num_tokens == 16
    batch = run_step(sched)
    assert [(r.seq_id, len(r.token_ids), r.start_position) for r in batch.rows] == [(0, 1, 4), (1, 15, 15)]
    batch = run_step(sched)
    assert [(r.seq_id, len(r.token_ids), r.sample) for r in batch.rows] == [(0, 1, True), (1, 10, True)]


def test_long_prefill_token_threshold_caps_a_prompts_chunk_and_leaves_room_for_the_next():
    """vLLM's long_prefill_token_threshold: a prompt computes at most that many tokens a step, and
    the budget left goes to the prompts behind it (without it the first takes the whole step)."""
    sched = make_scheduler(long_prefill_token_threshold=6)
    sched.add(make_seq(0, 20, max_tokens=2))
    sched.add(make_seq(1, 4, max_tokens=2))
    sched.add(make_seq(2, 10, max_tokens=2))
    batch = run_step(sched)
    assert [(r.seq_id, len(r.token_ids), r.sample) for r in batch.rows] == [(0, 6, False), (1, 4, True), (2, 6, False)]
    batch = run_step(sched)
    assert [(r.seq_id, len(r.token_ids)) for r in batch.rows] == [(0, 6), (1, 1), (2, 4)]
    while sched.has_unfinished():
        assert max(len(r.token_ids) for r in run_step(sched).rows) <= 6
    assert sched.finish_counts["length"] == 3
    uncapped = make_scheduler()
    uncapped.add(make_seq(0, 20))
    uncapped.add(make_seq(1, 4))
    assert [(r.seq_id, len(r.token_ids)) for r in run_step(uncapped).rows] == [(0, 16)]
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        make_scheduler(long_prefill_token_threshold=-1)


@pytest.mark.parametrize("computed_from", [0, 512, 513, None])
def test_a_step_padded_far_past_its_tokens_is_cut_to_the_bucket_below(computed_from):
    """Waiting prompts that would end a step in the lower half between two token buckets (from 64
    on) are cut to the lower bucket, the last prompt chunked and its rest first in the next step,
    where the upper bucket's step computes its padding; in the upper half, or under 64 tokens, or
    where the padding is skipped, the step is padded as before."""
    sched = make_scheduler(max_model_len=512, max_num_seqs=64, max_num_batched_tokens=512, page_size=16,
                           num_pages=200, enable_prefix_caching=False,  # (the prompts are alike)
                           padding_computed_from=computed_from)
    for i in range(9):
        sched.add(make_seq(i, 2, max_tokens=50))
    assert run_step(sched).num_tokens == 18  # (bucket 32)
    sched.add(make_seq(9, 128))
    sched.add(make_seq(10, 128))
    batch = run_step(sched)  # 9 + 256 tokens would be padded to 512
    if computed_from is None or computed_from > 512:
        assert batch.num_tokens == 9 + 256 and [len(r.token_ids) for r in batch.rows] == [1] * 9 + [128, 128]
        return
    assert batch.num_tokens == 256 and [len(r.token_ids) for r in batch.rows] == [1] * 9 + [128, 119]
    batch = run_step(sched)
    assert [(r.seq_id, len(r.token_ids)) for r in batch.rows[9:]] == [(9, 1), (10, 9)] and batch.rows[10].sample
    for i in range(3):
        sched.add(make_seq(11 + i, 128))
    assert run_step(sched).num_tokens == 11 + 3 * 128  # past 384 of 256..512: padded


def test_prompt_logprobs_come_once_each_in_order_through_chunks_and_preemption():
    """A sequence that asks for prompt logprobs reads nothing from the prefix cache and gets one per
    prompt token after the first, in order, though a preemption makes it compute its first chunk twice."""
    sched = make_scheduler(num_pages=7)  # 6 usable pages of 4 tokens
    sched.add(make_seq(0, 4, max_tokens=20))
    owing = make_seq(1, 20, max_tokens=4, prompt_logprobs=1)
    sched.add(owing)
    first = run_step(sched)  # seq 0's prompt, and 12 of seq 1's
    assert [(r.seq_id, r.prompt_logprobs) for r in first.rows] == [(0, False), (1, True)]
    assert len(owing.prompt_logprobs) == 12
    second = run_step(sched)  # seq 0's first decode takes a 5th page: seq 1 (8 more tokens, 2 pages) gives way
    assert second.preempted == [1] and owing.num_computed_tokens == 0
    while owing.num_computed_tokens == 0:
        run_step(sched)
    while owing.owes_prompt_logprobs:
        run_step(sched)
    assert owing.num_preemptions >= 1 and owing.num_cached_tokens == 0
    assert [lp.logprob for lp in owing.prompt_logprobs] == [-p for p in range(19)]
    sched.add(make_seq(2, 20, max_tokens=4))  # the same prompt, not asking: its pages are cached
    while not (rows := [r for r in run_step(sched).rows if r.seq_id == 2]):
        pass
    assert [(r.start_position, r.prompt_logprobs) for r in rows] == [(16, False)]


def test_max_num_seqs_bounds_the_batch():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add(make_seq(i, 2))
    assert [r.seq_id for r in run_step(sched).rows] == [0, 1]
    assert len(sched.waiting) == 3


def test_newest_running_sequence_is_preempted_when_pages_run_out():
    sched = make_scheduler(num_pages=5)  # 4 usable pages of 4 tokens
    sched.add(make_seq(0, 8, max_tokens=8))  # 2 pages, then grows
    sched.add(make_seq(1, 8, max_tokens=8))  # 2 pages
    run_step(sched)
    assert sched.allocator.num_free == 0
    batch = run_step(sched)  # seq 0 needs a third page: seq 1 (newest) gives its pages back
    assert batch.preempted == [1] and [r.seq_id for r in batch.rows] == [0]
    seq1 = sched.seqs[1]
    assert seq1.num_computed_tokens == 0 and seq1.page_ids == [] and sched.waiting[0] is seq1
    assert seq1.num_tokens == 9  # it keeps its sampled token and recomputes it later


def test_stops_eos_stop_ids_max_tokens_and_ignore_eos():
    sched = make_scheduler()
    eos = make_seq(0, 2)
    kept = make_seq(1, 2, ignore_eos=True)
    stop = make_seq(2, 2, stop_token_ids=[EOS, 5])
    for s in (eos, kept, stop):
        sched.add(s)
    run_step(sched, token=EOS)
    assert (eos.finish_reason, eos.stop_reason) == ("stop", None)
    assert (stop.finish_reason, stop.stop_reason) == ("stop", EOS)
    assert kept.finish_reason is None
    for _ in range(7):
        run_step(sched, token=EOS)
    assert kept.finish_reason == "length" and kept.num_output_tokens == 8
    assert sched.allocator.num_free == sched.allocator.num_usable and not sched.has_unfinished()


def test_logprobs_past_the_k_kept_come_from_the_whole_distribution_and_entropies_are_recorded():
    """A row asking for more top logprobs than the sampler keeps per token (or -1: all) takes them
    from its row of the step's whole distributions, highest first, ties by id as the sampler's top
    K; the others from the top K. Entropies are recorded where asked for."""
    sched = make_scheduler()
    every, many, few = make_seq(0, 2, logprobs=-1, return_entropy=True), make_seq(1, 2, logprobs=25), make_seq(2, 2,
                                                                                                           logprobs=1)
    for s in (every, many, few):
        sched.add(s)
    batch = sched.schedule()
    vocab = 40
    distributions = np.random.default_rng(0).normal(size=(3, vocab)).astype(np.float32)
    distributions[0, [3, 9]] = distributions[0].max() + 1  # a tie at the top
    out = outputs([5, 6, 7])
    out.entropies[:], out.distributions = [0.5, 1.5, 2.5], distributions
    sched.update(batch, out)
    assert every.logprobs[0].top_ids == np.argsort(-distributions[0], kind="stable").tolist()
    assert every.logprobs[0].top_ids[:2] == [3, 9] and len(every.logprobs[0].top_logprobs) == vocab
    assert many.logprobs[0].top_ids == np.argsort(-distributions[1], kind="stable")[:25].tolist()
    assert many.logprobs[0].top_logprobs == np.sort(distributions[1])[::-1][:25].tolist()
    assert few.logprobs[0].top_ids == [7]
    assert (every.entropies, many.entropies, few.entropies) == ([0.5], [], [])


def test_n_siblings_share_the_prompt_pages_and_copy_the_last_one_on_write():
    sched = make_scheduler()
    parent = make_seq(sched.new_seq_id(), 10, n=3)  # sibling ids come from the scheduler too
    sched.add(parent)
    batch = run_step(sched)  # all but the last prompt token: 9 tokens, 3 pages, nothing sampled
    assert [(r.seq_id, len(r.token_ids), r.sample) for r in batch.rows] == [(parent.seq_id, 9, False)]
    siblings = parent.forks
    assert [s.index for s in siblings] == [1, 2] and len({parent.seed, *(s.seed for s in siblings)}) == 3
    assert all(s.page_ids == parent.page_ids and s.num_computed_tokens == 9 for s in siblings)
    assert sched.allocator.num_usable - sched.allocator.num_free == 3  # shared, not copied
    batch = run_step(sched)  # each computes the last prompt token into its own copy of page 3
    assert [(len(r.token_ids), r.sample) for r in batch.rows] == [(1, True)] * 3
    assert len(batch.page_copies) == 2  # the last writer keeps the original
    last_pages = {s.page_ids[2] for s in (parent, *siblings)}
    assert len(last_pages) == 3 and {s.page_ids[0] for s in (parent, *siblings)} == {parent.page_ids[0]}
    assert sched.num_prompt_tokens_computed == 9 + 3
    for _ in range(8):
        run_step(sched)
    assert all(s.finish_reason == "length" for s in (parent, *siblings))
    assert sched.allocator.num_free == sched.allocator.num_usable


def test_a_sibling_that_cannot_join_the_batch_waits_without_pages():
    sched = make_scheduler(num_pages=9, max_num_seqs=2, max_num_batched_tokens=32)
    a = make_seq(sched.new_seq_id(), 9, max_tokens=4, n=2)
    b = make_seq(sched.new_seq_id(), 20, max_tokens=12)
    sched.add(a)
    sched.add(b)
    for _ in range(100):
        if not sched.has_unfinished():
            break
        run_step(sched)
    assert not sched.has_unfinished() and sched.allocator.num_free == sched.allocator.num_usable
    assert a.forks[0].num_output_tokens == 4 and b.num_output_tokens == 12


def test_requests_that_cannot_fit_are_refused():
    sched = make_scheduler()
    with pytest.raises(ValueError, match="exceeds max_model_len"):  # (the engine checks before it adds)
        sched.config.check_fits(60, 8)
    sched.config.check_fits(56, 8)
    small = make_scheduler(num_pages=3)
    with pytest.raises(ValueError, match="raise num_pages"):
        small.config.check_fits(10, 8)
    small.config.check_fits(4, 4)


def test_abort_frees_pages_at_once():
    sched = make_scheduler()
    sched.add(make_seq(0, 10))
    sched.add(make_seq(1, 3))
    run_step(sched)
    held = sched.allocator.num_usable - sched.allocator.num_free
    sched.abort(0)
    assert sched.allocator.num_usable - sched.allocator.num_free == held - 3  # seq 0 held 10 tokens = 3 pages
    assert sched.seqs.keys() == {1}
    run_step(sched)
    sched.abort(1)
    assert sched.allocator.num_free == sched.allocator.num_usable


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM("jaxserve-tiny", **CROWDED_ENGINE)  # (sequences of up to 76 tokens here)


def test_pages_all_return_after_300_random_requests_with_cancellations(tiny_llm):
    engine = tiny_llm.engine
    rng = np.random.default_rng(0)
    todo = [(rng.integers(0, 256, size=int(rng.integers(1, 60))).tolist(), int(rng.integers(1, 17)))
            for _ in range(300)]
    cancel_after = {i: int(rng.integers(0, 8)) for i in rng.choice(300, size=60, replace=False)}
    seqs: dict[int, Sequence] = {}
    while todo or engine.has_unfinished():
        for _ in range(int(rng.integers(0, 4))):
            if todo:
                prompt, max_tokens = todo.pop()
                i = len(seqs)
                seqs[i] = engine.add_request(f"req-{i}", prompt, SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=bool(i % 2), n=1 + (i % 7 == 0) * (i % 3)))
        engine.step()
        for i, seq in seqs.items():
            if i in cancel_after and not seq.is_finished and seq.num_output_tokens >= cancel_after[i]:
                engine.abort(seq.request_id)
    sched = engine.scheduler
    assert sorted(sched.allocator.free_page_ids()) == list(range(1, sched.config.num_pages))
    assert not sched.running and not sched.waiting and not sched.seqs
    assert sum(s.finish_reason == "abort" for s in seqs.values()) > 20

    forked = [f for s in seqs.values() for f in s.forks]
    assert forked and all(f.is_finished for f in forked)
    for seq in seqs.values():  # greedy siblings that ran to the end match their first choice
        for f in seq.forks:
            if "abort" not in (f.finish_reason, seq.finish_reason) and seq.params.ignore_eos:
                assert f.output_token_ids == seq.output_token_ids
    preempted = [s for s in seqs.values() if s.num_preemptions and s.finish_reason != "abort"]
    assert len(preempted) >= 3
    for seq in preempted[:8]:
        alone = tiny_llm.generate([seq.prompt_token_ids], seq.params)[0].outputs[0]
        assert alone.token_ids == seq.output_token_ids


def test_prompt_longer_than_max_model_len_is_refused(tiny_llm):
    with pytest.raises(ValueError, match="max_model_len"):
        tiny_llm.generate(["short", "x" * 120], SamplingParams(max_tokens=16))
    assert not tiny_llm.engine.has_unfinished()  # the valid prompt was withdrawn too
    with pytest.raises(ValueError, match="vocabulary"):
        tiny_llm.generate([[1, 2, 100000]])


def test_priority_orders_the_queue_and_a_waiting_higher_priority_preempts_the_lowest_running():
    sched = make_scheduler(max_num_seqs=2, scheduling_policy="priority")
    for i, priority in enumerate([5, 7]):
        seq = make_seq(i, 3, max_tokens=20)
        seq.priority = priority
        sched.add(seq)
    run_step(sched)
    assert [s.seq_id for s in sched.running] == [0, 1]
    for i, priority in [(2, 9), (3, 6), (4, 1), (5, 6)]:  # ties (3 and 5) by arrival
        seq = make_seq(i, 3, max_tokens=20)
        seq.priority = priority
        sched.add(seq)
    assert [s.seq_id for s in sched.waiting] == [4, 3, 5, 2]
    assert (sched.stats().num_queued_requests, sched.stats().num_queued_tokens) == (4, 12)
    batch = run_step(sched)  # 4 takes the seat of 1 (priority 7, the lowest running); 3 does not preempt 0 (5)
    assert batch.preempted == [1]
    assert [s.seq_id for s in sched.running] == [4, 0]
    assert [s.seq_id for s in sched.waiting] == [3, 5, 1, 2]  # the preempted one in its place, not first
    assert sched.stats().num_queued_requests == 3  # (1 has run: it is not new)


def test_priority_preempts_for_pages_lowest_priority_first():
    sched = make_scheduler(max_num_seqs=4, num_pages=5, scheduling_policy="priority")  # 4 usable pages of 4
    for i, priority in enumerate([3, 1]):
        seq = make_seq(i, 7, max_tokens=20)  # 2 pages each
        seq.priority = priority
        sched.add(seq)
    run_step(sched)
    assert [s.seq_id for s in sched.running] == [1, 0]  # in priority order
    urgent = make_seq(2, 7, max_tokens=20)
    sched.add(urgent)  # priority 0: no pages free, so 0 (priority 3) gives its pages up, not 1
    batch = run_step(sched)
    assert batch.preempted == [0] and [s.seq_id for s in sched.running] == [2, 1]
    late = make_seq(3, 7, max_tokens=20)
    late.priority = 2
    sched.add(late)  # not above the lowest running (1): it waits, ahead of the preempted 0 (priority 3)
    batch = run_step(sched)
    assert batch.preempted == [] and [s.seq_id for s in sched.waiting] == [3, 0]


def test_a_cache_salt_keeps_prefix_pages_apart():
    import hashlib

    sched = make_scheduler()
    salts = [None, b"a", b"a", b"b", None]
    for i, salt in enumerate(salts):
        seq = make_seq(i, 9, max_tokens=1)  # two full pages of 4
        seq.hash_seed = salt and hashlib.sha256(salt).digest()
        sched.add(seq)
        while sched.has_unfinished():
            run_step(sched)
        assert seq.num_cached_tokens == (8 if i in (2, 4) else 0), i
