"""Beam search, as vLLM's offline `LLM.beam_search`: on top of `LLM.generate`, one token a round.

Each round runs every live beam for one token with the top 2 x beam_width logprobs, extends each
beam by each of those tokens, and keeps, per prompt, the beam_width extensions of best score: the
cumulative logprob over the sequence's length (prompt included, a final EOS not) to the power
`length_penalty`. An extension that ends in EOS is complete and leaves the search; after max_tokens
rounds the live beams join the complete ones and the best beam_width of those come back, best
first. The prefix cache keeps each round's work to the beams' new tokens and their last page.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import TYPE_CHECKING

from jaxserve.config.engine import MAX_LOGPROBS, EngineConfig
from jaxserve.sample.params import SamplingParams

if TYPE_CHECKING:
    from jaxserve.engine.outputs import Logprob

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each round reads 2 x beam_width candidates per beam


@dataclasses.dataclass
class BeamSearchParams:
    """vLLM's names and defaults."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False  # EOS is then a token like any other
    temperature: float = 0.0  # of each round's one sampled token; candidates are scored by the logprobs
    # of the engine's logprobs_mode (raw_logprobs, the default: the model's distribution, as vLLM's)
    length_penalty: float = 1.0  # the exponent of the length a score divides by
    include_stop_str_in_output: bool = False  # (vLLM's field; beam search has no stop strings)

    def __post_init__(self):
        if not (isinstance(self.beam_width, int) and 1 <= self.beam_width <= MAX_BEAM_WIDTH):
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")


@dataclasses.dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated
    logprobs: list[dict[int, Logprob]]  # per generated token: the candidates it was chosen among
    cum_logprob: float = 0.0
    text: str | None = None  # the text of all its tokens, prompt included (as vLLM's LLM.beam_search)
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | None = None  # the EOS id that ended it


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def _score(beam: BeamSearchSequence, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    length = len(beam.tokens) - (beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / length ** length_penalty


def search(prompt_ids: list[list[int]], params: BeamSearchParams, eos_token_ids: frozenset[int],
           config: EngineConfig) -> Generator[list[list[int]], list[dict[int, Logprob]], list[BeamSearchOutput]]:
    """The search, for any way of running a round: it yields the token lists of the round's live
    beams, is sent back each one's next-token candidates (the top 2 x beam_width logprobs and the
    sampled token, as `SamplingParams.logprobs` gives them), and returns each prompt's best
    beam_width beams. `texts` are left to the caller."""
    eos = frozenset() if params.ignore_eos else eos_token_ids

    def key(beam: BeamSearchSequence) -> float:
        return _score(beam, eos, params.length_penalty)

    if not config.logprobs_mode.endswith("_logprobs"):  # (a sum of logits scores nothing)
        raise ValueError(f"beam search scores beams by their logprobs: it needs logprobs_mode raw_logprobs or "
                         f"processed_logprobs, not {config.logprobs_mode}")
    for ids in prompt_ids:
        config.check_fits(len(ids), params.max_tokens)
    live = [[BeamSearchSequence(tokens=ids, logprobs=[])] for ids in prompt_ids]
    complete: list[list[BeamSearchSequence]] = [[] for _ in prompt_ids]
    for _ in range(params.max_tokens):
        beams = [beam for per_prompt in live for beam in per_prompt]
        if not beams:
            break
        candidates_of = iter((yield [beam.tokens for beam in beams]))
        for p, per_prompt in enumerate(live):
            candidates = []
            for beam in per_prompt:
                logprobs = next(candidates_of)
                for token, logprob in logprobs.items():
                    new = BeamSearchSequence(tokens=beam.tokens + [token], logprobs=beam.logprobs + [logprobs],
                                             cum_logprob=beam.cum_logprob + logprob.logprob)
                    if token in eos:
                        new.finish_reason, new.stop_reason = "stop", token
                        complete[p].append(new)
                    else:
                        candidates.append(new)
            live[p] = sorted(candidates, key=key, reverse=True)[:params.beam_width]
    results = []
    for per_prompt, done in zip(live, complete):
        best = sorted(done + per_prompt, key=key, reverse=True)[:params.beam_width]
        for beam in best:
            beam.finish_reason = beam.finish_reason or "length"
        results.append(BeamSearchOutput(sequences=best))
    return results


def round_params(params: BeamSearchParams) -> SamplingParams:
    """One round of one beam: a token, with the 2 x beam_width candidates' logprobs."""
    return SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width,
                          ignore_eos=True)


