"""jaxserve against transformers' own PyTorch model, for every supported architecture.

Invariants: logits of a whole prompt through the paged cache equal transformers'
within 1e-4 (float32, max abs); the same prompt fed in chunks and single decode
tokens gives the same logits as in one go; greedy generation through the full
engine (8 prompts at once, chunked prefill, preemption, no compilation after start-up) equals
transformers' `generate` token for token, up to a tie (vLLM's rule: where the reference's top
two logits are within 1e-3, a divergence from there on is a tie). In bfloat16, vLLM's rule for a
lower precision: logprobs within a bfloat16 tolerance until the first difference, where each
token is among the other's top 5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SMALL_ENGINE
from hf_models import ARCHITECTURES, ATTN_CAP, FINAL_CAP
from test_compile import CompileCounter

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.models import ModelInputs, ReadRows, forward, rope_table
from jaxserve.models.config import ModelConfig
from jaxserve.worker.kv_cache import allocate_kv_cache
from jaxserve.worker.weights import load_weights
from jaxserve_kernels import cache_dtype

TIE_MARGIN = 1e-3
# bfloat16 keeps 8 significant bits: these models' logprobs move by a few hundredths under it
BF16_LOGPROB_ATOL = 0.15


def chunked_logits(model_dir, token_ids: list[int], chunks: list[int], page_size: int = 16,
                   dtype: str = "float32", kv_cache_dtype: str = "auto", quantization: str | None = None) -> np.ndarray:
    """Logits at every position of one sequence fed to the decoder in `chunks` (sizes summing to len)."""
    cfg = ModelConfig.from_hf(model_dir).for_context(128)
    engine_cfg = EngineConfig(max_model_len=128, page_size=page_size, num_pages=16, dtype=dtype,
                              kv_cache_dtype=kv_cache_dtype).resolve(cfg)
    graphdef, state = load_weights(model_dir, cfg, dtype, quantization=quantization)
    kv = allocate_kv_cache(cfg, engine_cfg)
    pages = np.array([9, 3, 14, 6, 11, 2, 7, 12], np.int32)  # out of order on purpose
    out, start = [], 0
    for n in chunks:
        pos = np.arange(start, start + n)
        inputs = ModelInputs(
            token_ids=np.asarray(token_ids[start:start + n], np.int32), positions=pos.astype(np.int32),
            rope=rope_table(cfg, pos),
            kv_write_index=(pages[pos // page_size] * page_size + pos % page_size).astype(np.int32),
            kv_lens=np.array([start + n], np.int32), page_table=pages[None, :],
            query_start=np.array([0, n], np.int32), num_seqs=np.asarray(1, np.int32),
            logits_indices=np.arange(n, dtype=np.int32))
        kv, logits, _ = forward(graphdef, state, kv, inputs)
        out.append(np.asarray(logits))
        start += n
    return np.concatenate(out)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_logits_match_transformers(arch, hf_checkpoint):
    model, model_dir = hf_checkpoint(arch)
    ids = np.random.default_rng(1).integers(0, model.config.get_text_config().vocab_size, size=40).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    got = chunked_logits(model_dir, ids, [40])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.abs(want).max() > 1.0  # the comparison is not between near-zero numbers


def test_longrope_past_the_original_context_takes_the_long_factors(tmp_path):
    """An engine whose context passes LongRoPE's original one rotates by the long factors at every
    position; transformers takes them once the sequence passes it: a 40-token prompt through a
    model whose original context is 32 gives the same logits."""
    from hf_models import build_hf_model, save_hf_model

    model = build_hf_model("phi3", original_max_position_embeddings=32)
    model_dir = save_hf_model(model, tmp_path)
    assert ModelConfig.from_hf(model_dir).for_context(128).rope.long
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, size=40).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(chunked_logits(model_dir, ids, [40]), want, atol=1e-4, rtol=0)


def test_gemma_soft_caps_bind(hf_checkpoint):
    """What makes the Gemma parity models test their soft-caps: the final logits reach near the
    cap, and without the attention soft-cap transformers' own logits move."""
    model, _ = hf_checkpoint("gemma2")
    ids = torch.tensor([np.random.default_rng(1).integers(0, 256, size=40).tolist()])
    with torch.no_grad():
        capped = model(ids).logits[0].numpy()
    assert np.abs(capped).max() > 0.9 * FINAL_CAP
    layers = [m for m in model.modules() if getattr(m, "attn_logit_softcapping", None) == ATTN_CAP]
    assert layers
    try:
        for layer in layers:
            layer.attn_logit_softcapping = None
        with torch.no_grad():
            uncapped = model(ids).logits[0].numpy()
    finally:
        for layer in layers:
            layer.attn_logit_softcapping = ATTN_CAP
    assert np.abs(uncapped - capped).max() > 1.0


def test_chunked_prefill_and_decode_equal_full_forward(hf_checkpoint):
    _, model_dir = hf_checkpoint("mistral")  # sliding window 24 < 40 tokens: the window matters here
    ids = np.random.default_rng(2).integers(0, 256, size=40).tolist()
    full = chunked_logits(model_dir, ids, [40])
    pieces = chunked_logits(model_dir, ids, [13, 16, 1, 1, 9])
    np.testing.assert_allclose(pieces, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3-moe"])
def test_the_last_layer_computes_only_the_rows_a_step_reads(arch, hf_checkpoint):
    """Two prompts in one step, some rows read (each prompt's last, two asked about): with
    `ReadRows` (as the engine sends them where the kernels skip rows) their logits are the whole
    step's, and the last layer's output at the other rows is not computed."""
    _, model_dir = hf_checkpoint(arch)
    cfg = ModelConfig.from_hf(model_dir).for_context(128)
    engine_cfg = EngineConfig(max_model_len=128, page_size=16, num_pages=16, dtype="float32").resolve(cfg)
    graphdef, state = load_weights(model_dir, cfg, "float32")
    lens, pages = [23, 17], np.array([[9, 3], [14, 6]], np.int32)
    pos = np.concatenate([np.arange(n) for n in lens])
    seq = np.repeat([0, 1], lens)
    read = np.array([22, 39, 5, 30], np.int32)
    inputs = ModelInputs(
        token_ids=np.random.default_rng(3).integers(0, cfg.vocab_size, size=40).astype(np.int32),
        positions=pos.astype(np.int32), rope=rope_table(cfg, pos),
        kv_write_index=(pages[seq, pos // 16] * 16 + pos % 16).astype(np.int32), kv_lens=np.array(lens, np.int32),
        page_table=pages, query_start=np.array([0, 23, 40], np.int32), num_seqs=np.asarray(2, np.int32),
        logits_indices=read)
    mask = np.isin(np.arange(40), read)
    rows = ReadRows(order=np.argsort(~mask, kind="stable").astype(np.int32), count=np.int32(len(read)))
    _, want, whole = forward(graphdef, state, allocate_kv_cache(cfg, engine_cfg), inputs)
    _, got, part = forward(graphdef, state, allocate_kv_cache(cfg, engine_cfg), inputs.replace(read_rows=rows))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(part)[read], np.asarray(whole)[read], atol=1e-5, rtol=0)
    assert np.abs(np.asarray(part)[~mask] - np.asarray(whole)[~mask]).max(-1).min() > 1e-2


def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.stack(out.logits)[:, 0].numpy()


def assert_same_greedy(got: list[int], want: list[int], ref_logits: np.ndarray) -> None:
    """Token for token, except after a step where the reference's top two logits tie."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            top2 = np.sort(ref_logits[i])[-2:]
            assert top2[1] - top2[0] < TIE_MARGIN, f"step {i}: got {g}, want {w} (margin {top2[1] - top2[0]:.4g})"
            return
    assert len(got) == len(want)


def assert_greedy_close(got, want: list[int], ref_logits: np.ndarray, *, atol: float, top_n: int = 5) -> int:
    """vLLM's rule for a lower precision, on a completion asked for `top_n` logprobs: token for
    token, each token's logprob within `atol` of the reference's log-softmax; at the first
    difference each token is among the other's top `top_n`, and the comparison stops there. The
    difference must also be one that errors of `atol` explain: the token taken is within 2 * atol
    of the reference's best. -> the number of tokens that agree."""
    ref = ref_logits.astype(np.float64)
    ref = ref - ref.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    for i, (g, w) in enumerate(zip(got.token_ids, want)):
        entry = got.logprobs[i]
        if g != w:
            assert g in np.argsort(-ref[i])[:top_n], f"step {i}: got {g}, not in the reference's top {top_n}"
            top = [t for t, lp in entry.items() if lp.rank <= top_n]
            assert w in top, f"step {i}: want {w}, not in the top {top_n}"
            assert ref[i, w] - ref[i, g] <= 2 * atol, f"step {i}: got {g}, {ref[i, w] - ref[i, g]:.3g} below the best"
            return i
        np.testing.assert_allclose(entry[g].logprob, ref[i, g], atol=atol, rtol=0, err_msg=f"step {i}")
    assert len(got.token_ids) == len(want)
    return len(want)


# One run per family by default; the other architectures differ in what their logits test covers
# (rope tables, biases, q/k norms, the window, Gemma 2's soft-caps, Qwen2-MoE's shared expert, the
# image-text checkpoint's form), which the default runs take through the engine: slow.
LLAMA_VARIANTS = ("llama-linear-rope", "llama3-rope", "mistral", "qwen2", "qwen3")
ENGINE_SLOW = (*LLAMA_VARIANTS, "gemma2", "gemma3-vision", "qwen2-moe")


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a in ENGINE_SLOW else a
                                  for a in ARCHITECTURES])
def test_engine_greedy_matches_transformers_generate(arch, hf_checkpoint):
    model, model_dir = hf_checkpoint(arch)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (5, 40, 17, 1, 33, 8, 26, 12)]
    # 12 usable pages for 8 sequences of up to 5 pages: some must be preempted.
    llm = LLM(str(model_dir), num_pages=13, **SMALL_ENGINE)
    with CompileCounter() as counter:  # every family's steps keep to the buckets compiled at start-up
        outputs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    assert counter.count == 0
    assert llm.engine.scheduler.num_preemptions >= 1
    for prompt, out in zip(prompts, outputs):
        want, ref_logits = _hf_greedy(model, prompt, 32)
        assert out.outputs[0].finish_reason == "length"
        assert_same_greedy(out.outputs[0].token_ids, want, ref_logits)
    assert len(set(outputs[1].outputs[0].token_ids)) > 4  # diverse paths, not one repeated token


# The families and rope variants ENGINE_SLOW leaves to the full run, each through the engine by default in
# a lighter run (two step shapes to compile): one prompt prefilled in chunks while another decodes beside it.
@pytest.mark.parametrize("arch", [a for a in ENGINE_SLOW if a != "gemma3-vision"])
def test_each_familys_engine_greedy_matches_transformers_generate(arch, hf_checkpoint):
    model, model_dir = hf_checkpoint(arch)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (29, 6)]
    llm = LLM(str(model_dir), max_model_len=48, max_num_seqs=2, max_num_batched_tokens=4, page_size=16)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        want, ref_logits = _hf_greedy(model, prompt, 16)
        assert_same_greedy(out.outputs[0].token_ids, want, ref_logits)


def test_engine_penalties_match_transformers_generate(hf_checkpoint):
    """Greedy decoding under a logit bias and repetition, frequency and presence penalties equals
    transformers' `generate` with the same as a logits processor. Steps are planned one ahead, so
    each step's penalties must count a token the host has not seen yet: without it, the biased
    token would be generated twice in a row."""
    from transformers import LogitsProcessor, LogitsProcessorList

    model, model_dir = hf_checkpoint("llama")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (9, 23, 4)]
    favourite = 77
    params = dict(logit_bias={favourite: 6.0}, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.4)

    class Reference(LogitsProcessor):  # jaxserve's order: bias, then repetition, then OpenAI's penalties
        def __init__(self, prompt_len: int):
            self.prompt_len = prompt_len

        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[:, favourite] += params["logit_bias"][favourite]
            seen = torch.gather(scores, 1, input_ids)
            rep = params["repetition_penalty"]
            scores.scatter_(1, input_ids, torch.where(seen > 0, seen / rep, seen * rep))
            generated = input_ids[:, self.prompt_len:]
            counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
            return scores - params["frequency_penalty"] * counts - params["presence_penalty"] * (counts > 0)

    llm = LLM(str(model_dir), **SMALL_ENGINE)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **params)
    outputs = llm.generate(prompts, sp, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                 logits_processor=LogitsProcessorList([Reference(len(prompt))]),
                                 output_scores=True, return_dict_in_generate=True,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        want = ref.sequences[0, len(prompt):].tolist()
        assert_same_greedy(out.outputs[0].token_ids, want, torch.stack(ref.scores)[:, 0].numpy())
        assert favourite in want and [favourite] * 2 not in [want[i:i + 2] for i in range(len(want))]


def _ranks_agree(rank: int, ref: np.ndarray, token: int, tol: float = 1e-4) -> bool:
    """rank = 1 + how many tokens the reference finds likelier, up to near-ties."""
    return np.sum(ref > ref[token] + tol) < rank <= 1 + np.sum(ref > ref[token] - tol)


def test_prompt_logprobs_and_ranks_match_transformers(hf_checkpoint):
    """Prompt logprobs (vLLM's `prompt_logprobs`): every prompt token's logprob, rank and the top
    k equal transformers' log-softmax, for prompts prefilled in chunks, in a batch that preempts
    (a recomputed chunk is not reported twice), past a prefix cache that holds the prompt (a
    request that asks reads nothing from it), and with n > 1 (reported once, by choice 0). A
    sampled token's rank too."""
    model, model_dir = hf_checkpoint("llama")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (5, 40, 17, 1, 33, 8, 26, 12)]
    llm = LLM(str(model_dir), num_pages=13, **SMALL_ENGINE)
    llm.generate(prompts[1], SamplingParams(max_tokens=1), use_tqdm=False)  # its pages enter the prefix cache
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions >= 1
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1).numpy()
        assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None and out.outputs[0].logprobs is None
        for i, entry in enumerate(out.prompt_logprobs[1:]):
            token = prompt[i + 1]
            assert list(entry)[0] == token and len(entry) in (3, 4)
            assert abs(entry[token].logprob - ref[i, token]) < 1e-4
            assert _ranks_agree(entry[token].rank, ref[i], token)
            top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= 3)
            assert [r for r, _ in top] == [1, 2, 3] and [t for _, t in top] == np.argsort(-ref[i])[:3].tolist()
    (both,) = llm.generate(prompts[1], SamplingParams(n=2, max_tokens=2, prompt_logprobs=0), use_tqdm=False)
    for i, entry in enumerate(both.prompt_logprobs[1:]):
        token = prompts[1][i + 1]
        assert list(entry) == [token] and abs(entry[token].logprob - outputs[1].prompt_logprobs[i + 1][token].logprob) < 1e-5
    (drawn,) = llm.generate(prompts[2], SamplingParams(max_tokens=1, temperature=1.0, seed=7, logprobs=0),
                            use_tqdm=False)
    token = drawn.outputs[0].token_ids[0]
    ((got, entry),) = drawn.outputs[0].logprobs[0].items()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompts[2]])).logits[0, -1].double(), -1).numpy()
    assert got == token and abs(entry.logprob - ref[token]) < 1e-4 and _ranks_agree(entry.rank, ref, token)


def test_long_prompts_in_the_few_sequences_bucket_match_transformers(hf_checkpoint):
    """A step of 64 tokens from at most 4 sequences runs padded to 4 sequence rows, not 8 (its
    attention in 16-row tiles): greedy generation still equals transformers'."""
    model, model_dir = hf_checkpoint("llama")
    llm = LLM(str(model_dir), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)
    assert llm.engine.config.seqs_buckets(64) == (4, 8)
    shapes = []
    shape = llm.engine.runner.shape
    llm.engine.runner.shape = lambda batch: shapes.append(shape(batch)) or shapes[-1]
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (61, 50, 3)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert (64, 4) in {s[:2] for s in shapes}
    for prompt, out in zip(prompts, outputs):
        want, ref_logits = _hf_greedy(model, prompt, 24)
        assert_same_greedy(out.outputs[0].token_ids, want, ref_logits)


@pytest.mark.parametrize("arch,kernel", [  # one by default: both kernels take the same path through the
    # engine, and tests/test_kernels.py checks each against the reference
    (arch, kernel) if (arch, kernel) == ("mistral", "gpu-interpret")
    else pytest.param(arch, kernel, marks=pytest.mark.slow)
    for arch in ARCHITECTURES for kernel in ("tpu-interpret", "gpu-interpret")])
def test_engine_on_pallas_kernels_matches_transformers(arch, kernel, hf_checkpoint, monkeypatch):
    """The engine with attention forced onto a Pallas kernel (run by Pallas' interpreter): logits of
    a chunked prompt and greedy generations (batched, chunked prefill, preemption) as above."""
    monkeypatch.setenv("JAXSERVE_ATTENTION", kernel)
    model, model_dir = hf_checkpoint(arch)
    ids = np.random.default_rng(1).integers(0, model.config.get_text_config().vocab_size, size=40).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(chunked_logits(model_dir, ids, [29, 1, 10]), want, atol=1e-4, rtol=0)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (5, 40, 17, 1, 33, 8)]
    llm = LLM(str(model_dir), num_pages=11, **SMALL_ENGINE)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions >= 1
    for prompt, out in zip(prompts, outputs):
        want, ref_logits = _hf_greedy(model, prompt, 20)
        assert_same_greedy(out.outputs[0].token_ids, want, ref_logits)


def test_bfloat16_close_to_float32(hf_checkpoint):
    """bfloat16 weights, activations and cache: logits near transformers' float32 ones, and greedy
    generations through the engine (batched, chunked prefill) close to transformers' float32 ones
    by vLLM's rule, their logprobs within BF16_LOGPROB_ATOL."""
    model, model_dir = hf_checkpoint("llama")
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 256, size=24).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    got = chunked_logits(model_dir, ids, [16, 8], dtype="bfloat16")
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 0.05, err
    llm = LLM(str(model_dir), dtype="bfloat16", **SMALL_ENGINE)
    assert llm.engine.runner.kv.k[0].dtype == cache_dtype("bfloat16")  # on CPU: its bits, as uint16
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
    prompts = [ids, *(rng.integers(0, 256, size=n).tolist() for n in (7, 40, 2))]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5),
                           use_tqdm=False)
    agreed = 0
    for prompt, out in zip(prompts, outputs):
        want_tokens, ref_logits = _hf_greedy(model, prompt, 16)
        agreed += assert_greedy_close(out.outputs[0], want_tokens, ref_logits, atol=BF16_LOGPROB_ATOL)
    assert agreed >= 16  # the comparison was not all cut short by near-ties


def test_bfloat16_kv_cache_of_a_float32_model(hf_checkpoint):
    """kv_cache_dtype="bfloat16" under float32 weights: the cache holds bfloat16 values (its bits on
    CPU), and the logits stay nearer transformers' float32 ones than with everything in bfloat16
    (at most half the error).
    Through `LLM`, vLLM's names for the cache's settings give the same engine as jaxserve's."""
    model, model_dir = hf_checkpoint("llama")
    ids = np.random.default_rng(5).integers(0, 256, size=40).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    scale = np.abs(want).max()
    err = np.abs(chunked_logits(model_dir, ids, [24, 1, 15], kv_cache_dtype="bfloat16") - want).max() / scale
    all_bf16 = np.abs(chunked_logits(model_dir, ids, [24, 1, 15], dtype="bfloat16") - want).max() / scale
    assert 1e-6 < err < all_bf16 / 2, (err, all_bf16)  # rounded, but only the cache: 0.0095 against 0.045
    small = {k: v for k, v in SMALL_ENGINE.items() if k != "page_size"}
    llm = LLM(str(model_dir), kv_cache_dtype="bfloat16", block_size=SMALL_ENGINE["page_size"],
              gpu_memory_utilization=0.5, **small)
    config = llm.engine.config
    assert (config.dtype, config.kv_cache_dtype, config.page_size) == ("float32", "bfloat16", 16)
    assert llm.engine.runner.kv.k[0].dtype == cache_dtype("bfloat16")
    out = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5),
                       use_tqdm=False)
    first, top2 = out[0].outputs[0].token_ids[0], np.sort(want[-1])[-2:]
    assert first == want[-1].argmax() or top2[1] - top2[0] < 2 * err * scale
    assert len(out[0].outputs[0].token_ids) == 6
    assert_greedy_close(out[0].outputs[0], *_hf_greedy(model, ids, 6), atol=BF16_LOGPROB_ATOL)
    with pytest.raises(ValueError, match="one setting"):
        LLM(str(model_dir), page_size=16, block_size=32)
    with pytest.raises(ValueError, match="fp8"):
        EngineConfig(max_model_len=128, kv_cache_dtype="fp8")
