"""Shared fixtures: tiny HF checkpoints on disk and small engine settings that compile fast."""

from __future__ import annotations

import pytest

from hf_models import build_hf_model, save_hf_model

# Engine settings for tests: 2 token buckets x 2 page buckets keep warm-up short,
# and the 32-token budget forces prefill into chunks.
SMALL_ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, page_size=16)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """name -> (torch model, directory with its HF checkpoint); built once per session."""
    cache = {}

    def get(name: str):
        if name not in cache:
            model = build_hf_model(name)
            cache[name] = (model, save_hf_model(model, tmp_path_factory.mktemp(name)))
        return cache[name]

    return get
