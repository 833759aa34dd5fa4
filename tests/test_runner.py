"""The runner's step inputs: named, padded to their bucket, packed and unpacked, and the inputs no
row uses sent to the device once, keyed by their value."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import CROWDED_ENGINE

from jaxserve import LLM, SamplingParams
from jaxserve.sample.params import RequestSampling
from jaxserve.sample.tensors import Padding
from jaxserve.sched.plan import ScheduledBatch, ScheduledSeq
from jaxserve.worker.step_fn import StepInputs


@pytest.fixture(scope="module")
def runner():
    return LLM("jaxserve-tiny", **CROWDED_ENGINE).engine.runner


def batch(params: SamplingParams) -> ScheduledBatch:
    """One row: a 3-token prompt on page 1 that asks for its prompt logprobs; page 2 copied to 3 first."""
    row = ScheduledSeq(seq_id=0, token_ids=[5, 6, 7], start_position=0, pending_row=-1, page_ids=[1], sample=True,
                       params=params, sampling=RequestSampling(), seed=0, all_token_ids=[5, 6, 7], num_prompt_tokens=3,
                       prompt_logprobs=True)
    return ScheduledBatch(rows=[row], num_tokens=3, preempted=[], page_copies=[(2, 3)])


def test_the_step_inputs_are_named_and_padded_to_their_bucket(runner):
    plan = batch(SamplingParams(presence_penalty=0.5))
    tokens, seqs, width = shape = runner.shape(plan)
    inputs = runner.prepare(plan)
    assert isinstance(inputs, StepInputs)
    assert inputs.page_copies.shape == (seqs, 2) and inputs.page_copies[0].tolist() == [2, 3]
    assert inputs.pending.shape == inputs.prompt_rows.shape == inputs.prompt_targets.shape == (tokens,)
    assert inputs.prompt_rows[:2].tolist() == [0, 1] and inputs.prompt_targets[:3].tolist() == [6, 7, -1]
    assert inputs.model.token_ids.shape == (tokens,) and inputs.model.token_ids[:3].tolist() == [5, 6, 7]
    assert inputs.model.page_table.shape == (seqs, width) and inputs.model.logits_indices[0] == 2
    assert inputs.sampling.temperature.shape == (seqs,)
    # the penalties' history is used by the row; the token mask by no row: it is the bucket's padding
    assert inputs.sampling.history.shape == (seqs, runner.config.max_model_len)
    assert isinstance(inputs.sampling.history, np.ndarray) and inputs.sampling.history[0, :3].tolist() == [5, 6, 7]
    assert isinstance(inputs.sampling.token_mask, Padding) and inputs.sampling.token_mask.shape[0] == seqs
    assert isinstance(runner.prepare(batch(SamplingParams())).sampling.history, Padding)

    # packed into the step's arguments, they unpack to the same named inputs
    unpacked = runner._args(inputs, shape)[2].unpack()
    assert isinstance(unpacked, StepInputs)
    jax.tree.map(lambda got, want: np.testing.assert_array_equal(np.asarray(got), np.asarray(want)), unpacked, inputs)


def test_a_padding_has_one_device_copy_keyed_by_its_value(runner):
    """Paddings come and go (host arrays freed, their ids reused): each device copy is of its own
    padding's contents, and equal paddings share one."""
    for fill in range(100):
        padding = Padding((4, 64), fill, "int32")
        np.testing.assert_array_equal(np.asarray(runner.padding_on_device(padding)), np.full((4, 64), fill))
    once = runner.padding_on_device(Padding((4, 64), 7, "int32"))
    assert runner.padding_on_device(Padding((4, 64), 7, "int32")) is once
    for other in (Padding((4, 64), 8, "int32"), Padding((4, 64), 7, "float32"), Padding((64, 4), 7, "int32")):
        copy = runner.padding_on_device(other)
        assert copy is not once and copy.dtype == other.dtype and copy.shape == other.shape
        np.testing.assert_array_equal(np.asarray(copy), np.full(other.shape, other.fill, other.dtype))


def test_a_padding_is_a_shared_read_only_host_array():
    padding = Padding((2, 3), 5, "int32")
    array = np.asarray(padding)
    assert array is np.asarray(Padding((2, 3), 5, "int32")) and not array.flags.writeable
    np.testing.assert_array_equal(array, np.full((2, 3), 5, np.int32))
    copy = np.array(padding, dtype=np.float32)
    assert copy.flags.writeable and copy.dtype == np.float32 and (copy == 5).all()
