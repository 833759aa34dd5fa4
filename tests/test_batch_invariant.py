"""Batch invariance (`batch_invariant=True`): one request's raw logprobs, at every prompt position
and every generated token, are bitwise the same whether it runs alone or among other requests:
batches of 2 to 32 sequences, its prompt cut into different chunks by the token budget and by what
shares its steps, arriving while others decode, its prefix found in the prefix cache or not.

Without the mode the same mixes change its logprobs on this CPU already, in float32 on jaxserve-tiny:
XLA and the C++ matmul kernel add up a product's terms in an order that depends on the number of rows
(`test_without_the_mode_some_mix_differs`), which is what the mode is for.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.models import ModelInputs
from jaxserve.models.invariant import ROWS, tile_inputs
from jaxserve.sched.sequence import Sequence, TokenLogprobs
from jaxserve_kernels import paged_attention

# A 32-token budget cuts the target's 45-token prompt into chunks whose sizes depend on what else
# the step holds; 32 sequences at once is the largest batch.
ENGINE = dict(model="jaxserve-tiny", max_model_len=128, max_num_seqs=32, max_num_batched_tokens=32,
              page_size=16, num_pages=160)
RNG = np.random.default_rng(7)
PREFIX = RNG.integers(0, 256, 32).tolist()  # two whole pages: a prefix the cache can hold
TARGET = PREFIX + RNG.integers(0, 256, 13).tolist()
SCORED = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=5, ignore_eos=True)
# seeded sampling, its top 20 logprobs per generated token (prompt logprobs skip the prefix cache)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=8, logprobs=20, ignore_eos=True)
OTHER = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


class Arrival(NamedTuple):
    step: int  # the engine step before which it is added
    prompt: list[int]
    params: SamplingParams
    is_target: bool = False  # the request whose logprobs are compared (the last such, where several)


def others(count: int, lo: int, hi: int, step: int = 0, params: SamplingParams = OTHER) -> list[Arrival]:
    """`count` requests of random prompts of lo to hi - 1 tokens."""
    return [Arrival(step, RNG.integers(0, 256, int(RNG.integers(lo, hi))).tolist(), params) for _ in range(count)]


def target(step: int = 0, params: SamplingParams = SCORED) -> list[Arrival]:
    return [Arrival(step, TARGET, params, is_target=True)]


# Eight mixes besides "alone": the target first, last or in the middle; among short and long
# prompts; arriving while the others decode (then its chunks share steps with decode rows, down to
# one token a step beside 31 of them).
MIXES = {
    "alone": target(),
    "second of 2": others(1, 20, 40) + target(),
    "first of 3": target() + others(2, 5, 60),
    "middle of 5": others(2, 30, 60) + target() + others(2, 5, 20),
    "last of 8": others(7, 3, 12) + target(),
    "into 11 decoding": others(11, 5, 30) + target(step=4),
    "among 16": others(9, 5, 50) + target() + others(6, 5, 50),
    "last of 24": others(23, 2, 8) + target(),
    "into 31 decoding": others(31, 1, 3, params=SamplingParams(max_tokens=24, ignore_eos=True)) + target(step=3),
}


class Result(NamedTuple):
    tokens: tuple[int, ...]
    prompt: bytes  # every prompt position's logprobs, as float32 bits
    output: bytes  # every generated token's
    chunks: tuple[int, ...]  # how the target's prompt was cut into steps
    batch_sizes: tuple[int, ...]  # sequences in each step the target was in
    cached: int  # its prompt tokens read from the prefix cache


def _bits(entries: list[TokenLogprobs]) -> bytes:
    return np.asarray([[e.logprob, *e.top_logprobs] for e in entries], np.float32).tobytes()


def run(llm: LLM, arrivals: list[Arrival]) -> Result:
    """Run the arrivals through the engine step by step; the target's logprobs and steps."""
    engine, ids = llm.engine, itertools.count()
    waiting, step, seq, steps = sorted(arrivals, key=lambda a: a.step), 0, None, []
    launch = engine.runner.launch

    def spy(batch, *staged):
        row = next((r for r in batch.rows if seq is not None and r.seq_id == seq.seq_id), None)
        if row is not None:
            steps.append((len(row.token_ids) if row.start_position < len(TARGET) else 0, len(batch.rows)))
        return launch(batch, *staged)

    engine.runner.launch = spy
    try:
        while waiting or engine.has_unfinished():
            while waiting and waiting[0].step <= step:
                arrival = waiting.pop(0)
                added = engine.add_request(f"r{next(ids)}", arrival.prompt, arrival.params)
                seq = added if arrival.is_target else seq
            engine.step()
            step += 1
    finally:
        engine.runner.launch = launch
    assert isinstance(seq, Sequence) and seq.is_finished
    return Result(tuple(seq.output_token_ids), _bits(seq.prompt_logprobs), _bits(seq.logprobs),
                  tuple(n for n, _ in steps if n), tuple(b for _, b in steps), seq.num_cached_tokens)


@pytest.fixture(scope="module")
def invariant_llm():
    return LLM(**ENGINE, batch_invariant=True)


def test_logprobs_are_bitwise_equal_in_every_mix(invariant_llm):
    results = {name: run(invariant_llm, arrivals) for name, arrivals in MIXES.items()}
    alone = results["alone"]
    assert len(alone.prompt) == (len(TARGET) - 1) * 6 * 4 and len(alone.output) == 8 * 6 * 4
    for name, result in results.items():
        assert (result.tokens, result.prompt, result.output) == (alone.tokens, alone.prompt, alone.output), name
    # the mixes did what they are for: batches from 2 to 32 sequences, the prompt cut several ways,
    # the widest page table only
    sizes = {b for r in results.values() for b in r.batch_sizes}
    assert {1, 2, 32} <= sizes, sizes
    assert len({r.chunks for r in results.values()}) >= 4, {name: r.chunks for name, r in results.items()}
    config = invariant_llm.engine.config
    assert config.page_buckets == (config.max_pages_per_seq,)
    with pytest.raises(ValueError, match="batch_invariant reads one page-table width"):
        EngineConfig(batch_invariant=True, page_table_widths="4x")


def test_prefix_cache_hits_and_seeded_sampling_are_invariant(invariant_llm):
    """The target's generated tokens and their top 20 logprobs, seeded sampling, with its first
    two pages computed by another request (prefix-cache hits) or by itself."""
    invariant_llm.reset_prefix_cache()
    alone = run(invariant_llm, target(params=SEEDED))
    assert alone.cached == 0
    hits = {
        "after its own prompt": [Arrival(0, TARGET, OTHER)] + target(step=20, params=SEEDED),
        "after its prefix, among 6": [Arrival(0, PREFIX + [1, 2, 3], OTHER)] + others(5, 5, 40, step=20)
                                     + target(step=20, params=SEEDED),
        "twice at once, among 12": others(10, 5, 40) + target(params=SEEDED) + target(params=SEEDED),
    }
    for name, arrivals in hits.items():
        invariant_llm.reset_prefix_cache()
        result = run(invariant_llm, arrivals)
        assert (result.tokens, result.output) == (alone.tokens, alone.output), name
        if name != "twice at once, among 12":
            assert result.cached == len(PREFIX), name


@pytest.mark.parametrize("sampler", [dict(mirostat=2), dict(typical_p=0.9, xtc_probability=0.5, xtc_threshold=0.05),
                                     dict(dry_multiplier=0.8, dynatemp_range=0.5, top_n_sigma=2.0)],
                         ids=["mirostat-2", "typical-xtc", "dry-dynatemp-top-n-sigma"])
def test_llamacpp_samplers_are_invariant(invariant_llm, sampler):
    """llama.cpp's samplers (processors in the per-sequence sampler, drawing by (seed, position)):
    the target's tokens and top 20 logprobs in every mix as alone."""
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=12, logprobs=20, ignore_eos=True, **sampler)
    results = {name: run(invariant_llm, [a._replace(params=params) if a.is_target else a for a in arrivals])
               for name, arrivals in MIXES.items()}
    alone = results["alone"]
    for name, result in results.items():
        assert (result.tokens, result.output) == (alone.tokens, alone.output), name


@pytest.fixture(scope="module")
def plain_llm():
    return LLM(**ENGINE)


def test_without_the_mode_some_mix_differs(plain_llm):
    """What the mode buys: without it, the same mixes give the target other logprobs (on this CPU
    in float32: a step of 16 rows or more multiplies in the C++ kernel's panel form, a step of fewer
    in its dot form, and XLA's norms reduce by shape)."""
    results = {name: run(plain_llm, arrivals) for name, arrivals in MIXES.items()}
    alone = results["alone"]
    differ = [name for name, r in results.items() if (r.prompt, r.output) != (alone.prompt, alone.output)]
    assert differ, "no mix changed the logprobs without batch_invariant"


SLOW = pytest.mark.slow  # (another engine to compile each)


@pytest.mark.parametrize("options", [
    pytest.param(dict(quantization="int8"), id="int8"),
    pytest.param(dict(dtype="bfloat16"), id="bfloat16", marks=SLOW),
    pytest.param(dict(max_num_batched_tokens=16), id="budget-16", marks=SLOW),
    pytest.param(dict(max_num_batched_tokens=64), id="budget-64", marks=SLOW),
])
def test_other_weights_and_budgets_are_invariant(invariant_llm, options):
    """int8 weights (through the C++ quantized kernel), bfloat16, and other token budgets: the
    target's logprobs in every mix equal its logprobs alone; with another budget, alone in the first
    engine (the tiles are the same whatever the budget)."""
    llm = LLM(**{**ENGINE, **options}, batch_invariant=True)
    reference = run(llm if "max_num_batched_tokens" not in options else invariant_llm, MIXES["alone"])
    for name, arrivals in MIXES.items():
        result = run(llm, arrivals)
        assert (result.tokens, result.prompt, result.output) == (reference.tokens, reference.prompt,
                                                                 reference.output), name


def _step_inputs(seqs: list[tuple[int, int, list[int]]], num_tokens: int) -> ModelInputs:
    """A step's inputs for the attention: (tokens cached before, tokens this step, page table) per
    sequence; the token arrays are padding (attention reads none of them)."""
    lens = [cached + new for cached, new, _ in seqs]
    starts = np.cumsum([0] + [new for _, new, _ in seqs])
    num_rows = max(len(seqs), 4)
    table = np.zeros((num_rows, 8), np.int32)
    for b, (_, _, pages) in enumerate(seqs):
        table[b, :len(pages)] = pages
    zeros = np.zeros(num_tokens, np.int32)
    return ModelInputs(token_ids=zeros, positions=zeros, rope=np.zeros((1, num_tokens, 2), np.float32),
                       kv_write_index=zeros, kv_lens=np.asarray(lens + [0] * (num_rows - len(seqs)), np.int32),
                       page_table=table, query_start=np.asarray(list(starts) + [starts[-1]] * (num_rows - len(seqs)),
                                                                 np.int32),
                       num_seqs=np.asarray(len(seqs), np.int32), logits_indices=np.zeros(num_rows, np.int32))


@pytest.mark.parametrize("impl", ["cpu", "xla", "reference", "tpu-interpret", "gpu-interpret"])
def test_every_attention_gives_a_row_the_same_output_in_every_tile(impl):
    """What the mode asks of an attention implementation: under the tiles' fixed shapes, a query
    row's output depends on its own sequence alone, not on where it sits in the tile or what else
    does. Target positions 30 to 39 (pages 5, 2, 9) attended alone, behind other sequences' rows,
    as decodes beside other decodes; the Pallas kernels in their interpreters."""
    rng = np.random.default_rng(0)
    num_heads, kv_heads, head_dim, page_size = 4, 2, 32, 16
    k_pages, v_pages = (jnp.asarray(rng.normal(size=(12, page_size, kv_heads, head_dim)), jnp.float32)
                        for _ in range(2))
    query = rng.normal(size=(40, num_heads, head_dim)).astype(np.float32)  # the target's, by position
    pages = [5, 2, 9]
    steps = {  # [(cached, new, pages)], where the target is
        "alone": ([(30, 10, pages)], 0),
        "behind a prompt": ([(0, 5, [1]), (30, 10, pages)], 1),
        "behind two": ([(12, 3, [3]), (0, 6, [4, 6]), (30, 10, pages)], 2),
        "decodes": ([(20, 1, [1, 3]), (5, 1, [4]), (30, 1, pages)], 2),
        "last decode": ([(20, 1, [1, 3])] * 7 + [(38, 1, pages)], 7),
    }
    # (one shape; each row alone, as the layers ask for a tile: `ModelInputs.batch_invariant`)
    attend = jax.jit(functools.partial(paged_attention, sm_scale=head_dim**-0.5, impl=impl, row_by_row=True))
    split = jax.jit(tile_inputs, static_argnums=2)
    outputs = {}
    for name, (seqs, which) in steps.items():
        first = sum(new for _, new, _ in seqs[:which])
        num_tokens = -(-sum(new for _, new, _ in seqs) // ROWS) * ROWS
        inputs = _step_inputs(seqs, num_tokens)
        cached, new, _ = seqs[which]
        for start in range(0, num_tokens, ROWS):
            tile = split(inputs, start, ROWS)
            assert tile.batch_invariant
            q = rng.normal(size=(ROWS, num_heads, head_dim)).astype(np.float32)
            rows = [r for r in range(ROWS) if first <= start + r < first + new]
            for r in rows:
                q[r] = query[cached + start + r - first]
            out = np.asarray(attend(jnp.asarray(q), k_pages, v_pages, tile.kv_lens, tile.page_table,
                                    tile.query_start, tile.num_seqs))
            for r in rows:
                outputs.setdefault(cached + start + r - first, []).append((name, out[r].tobytes()))
    assert len(outputs) == 10
    for position, seen in outputs.items():
        assert len({bits for _, bits in seen}) == 1, (position, [name for name, _ in seen])


def test_scoring_a_generated_sequence_gives_its_sampled_logprobs(invariant_llm):
    """Fed back as a prompt (prompt_logprobs), a generated sequence scores each of its tokens with the
    logprobs it was sampled with, bit for bit: what an RL trainer reads back matches the rollout."""
    prompts = [TARGET, PREFIX, TARGET[5:30]]
    params = dict(logprobs=5, ignore_eos=True)
    generated = invariant_llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=24, **params),
                                       use_tqdm=False)
    scored = invariant_llm.generate([p + g.outputs[0].token_ids for p, g in zip(prompts, generated)],
                                    SamplingParams(max_tokens=1, prompt_logprobs=5, ignore_eos=True), use_tqdm=False)
    for prompt, gen, score in zip(prompts, generated, scored):
        bits = lambda entry: {t: np.float32(lp.logprob).tobytes() for t, lp in entry.items()}  # noqa: E731
        sampled = [bits(entry) for entry in gen.outputs[0].logprobs]
        rescored = [bits(entry) for entry in score.prompt_logprobs[len(prompt):]]
        assert rescored == sampled


TENSOR_PARALLEL = """
import json, test_batch_invariant as t
from jaxserve import LLM
llm = LLM(**t.ENGINE, tensor_parallel_size=2, batch_invariant=True)
results = {name: t.run(llm, arrivals) for name, arrivals in t.MIXES.items()}
alone = results["alone"]
print(json.dumps([name for name, r in results.items() if r[:3] != alone[:3]]))
"""


@SLOW
def test_tensor_parallel_steps_are_invariant():
    """Over 2 (virtual CPU) devices, where XLA partitions the products: every mix as alone."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", TENSOR_PARALLEL], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
