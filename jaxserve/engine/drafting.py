"""Speculative decoding's side of a step in the engine: whether it drafts, the draft tokens of each
running sequence (the rows that check them are the scheduler's, `add_drafts`), and a draft model's
proposals once the step is planned."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.config.engine import EngineConfig
from jaxserve.sched.plan import ScheduledBatch
from jaxserve.sched.sequence import Sequence, SequenceStatus
from jaxserve.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from jaxserve.worker.draft import DraftModel


def speculates(config: EngineConfig, running: list[Sequence]) -> bool:
    """Whether the next step drafts: while few enough sequences run that checking drafts costs less
    than it saves (`SpeculativeConfig.disable_by_batch_size`), and one of them decodes and may
    draft (`may_draft`)."""
    return config.speculative is not None and 0 < len(running) <= config.speculative.disable_by_batch_size and any(
        may_draft(seq) and seq.num_computed_tokens >= seq.num_tokens - 1 for seq in running)


def may_draft(seq: Sequence) -> bool:
    """Not under a grammar or a logits processor that carries state from token to token: the next
    token's mask or state needs the token before it on the host."""
    return seq.params.constraint is None and not seq.sampling.carries


def draft_tokens(config: EngineConfig, running: list[Sequence], proposer: NgramProposer | None
                 ) -> dict[int, list[int]]:
    """Draft tokens for the running sequences whose next step computes just their last token
    (`may_draft`): up to num_speculative_tokens, no more than their max_tokens and max_model_len
    leave room for. Without a `proposer` (a draft model's) they are placeholders, made once the
    step is planned (`propose`: its rows' pages are then there for their K/V)."""
    k, max_len = config.speculative.num_speculative_tokens, config.max_model_len
    drafts = {}
    for seq in running:
        if (seq.status is not SequenceStatus.RUNNING or seq.num_pending
                or seq.num_computed_tokens != seq.num_tokens - 1 or not may_draft(seq)):
            continue
        room = min(k, seq.max_tokens - seq.num_output_tokens - 1, max_len - seq.num_tokens - 1)
        if room < 1:
            continue
        proposal = [0] * room if proposer is None else proposer.propose(seq.token_ids, room)
        if proposal:
            drafts[seq.seq_id] = proposal[:room]
    return drafts


def propose(draft: DraftModel, batch: ScheduledBatch) -> None:
    """The draft model's tokens in place of the rows' placeholders."""
    rows = [row for row in batch.rows if row.draft_token_ids]
    proposals = draft.propose([(row.token_ids[0], row.start_position, row.page_ids) for row in rows])
    for row, proposal in zip(rows, proposals):
        row.set_drafts(proposal)
