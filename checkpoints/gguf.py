"""GGUF files (llama.cpp's format) -> a model directory and the model's parameters.

A GGUF file holds the config, the tokenizer, the chat template and the weights. `model_view`
writes what the rest of jaxserve reads from a Hugging Face directory (config.json,
generation_config.json, the tokenizer files, made by transformers from the file's metadata) once
into the cache, beside a pointer to the file (VIEW_MARKER); `load_gguf_params` reads the tensors
from the file itself (`gguf`, llama.cpp's own reader, memory maps it).

A tensor goes to the format its parameter is kept in (`ParamTarget.formats`): blocks of Q8_0,
Q4_0 and Q4_1 are the int8 and int4 formats of `kernels.matmul.quant` as they lie; other types
are dequantized, then quantized again where kept quantized, or cast to the float dtype.

A Mixture-of-Experts layer's experts lie stacked in one tensor per projection, [experts, out, in]
(`blk.N.ffn_gate_exps`): each expert's slice loads under its Hugging Face name (`EXPERT_HF_NAMES`),
quantized blocks as they lie. Mixtral is GGUF architecture `llama` with an expert count.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import re
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from checkpoints.default_model import cache_root
from checkpoints.target import ParamTarget, param_paths
from kernels.matmul.quant import BLOCK, QuantizedWeight

log = logging.getLogger(__name__)

VIEW_MARKER = "gguf.json"  # in a model view: {"file": the GGUF file}
VIEW_VERSION = 3  # bump when the files a view holds change
# tokens that end a turn by their text, which llama.cpp also stops at (beside the file's eos, eot
# and eom ids): chat models' end-of-turn markers
END_OF_TURN = ("<end_of_turn>", "<|end|>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>", "<EOT>")
# GGUF general.architecture -> the Hugging Face architecture it is served as
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
WITH_EXPERTS = {"llama": "MixtralForCausalLM"}  # GGUF architectures served as another when they have experts
SOFTMAX_GATING = 1  # llama.cpp's expert_gating_func for softmax routing, the one the models here route by
# llama.cpp's converter interleaves the two halves of each head's q and k rows for these (its rope layout)
PERMUTED_QK = ("llama",)
# llama.cpp's converter stores Gemma's norm weights w as 1 + w (the scale its (1 + w) norms apply)
NORMS_PLUS_ONE = ("gemma2", "gemma3")
# the tensor types read; the others are an error naming them
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# types whose blocks are a format as they lie (Q5_0's values, 5-bit multiples of its scale, fit int8's)
DIRECT = {"Q8_0": "int8", "Q5_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}
# the format a tensor of each quantized type is kept in when the file decides (quantization "gguf")
KEPT_AS = {"Q8_0": "int8", "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8", "Q6_K": "int8",
           "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4"}

# GGUF tensor name -> Hugging Face's (then the family's name map takes it to a parameter path)
HF_NAMES = {
    r"token_embd\.weight": r"model.embed_tokens.weight",
    r"output_norm\.weight": r"model.norm.weight",
    r"output\.weight": r"lm_head.weight",
    r"blk\.(\d+)\.attn_norm\.weight": r"model.layers.\1.input_layernorm.weight",
    r"blk\.(\d+)\.ffn_norm\.weight": r"model.layers.\1.post_attention_layernorm.weight",
    r"blk\.(\d+)\.attn_(q|k|v)\.(weight|bias)": r"model.layers.\1.self_attn.\2_proj.\3",
    r"blk\.(\d+)\.attn_output\.(weight|bias)": r"model.layers.\1.self_attn.o_proj.\2",
    r"blk\.(\d+)\.attn_(q|k)_norm\.weight": r"model.layers.\1.self_attn.\2_norm.weight",
    r"blk\.(\d+)\.ffn_(gate|up|down)\.(weight|bias)": r"model.layers.\1.mlp.\2_proj.\3",
    r"blk\.(\d+)\.ffn_gate_inp\.weight": r"model.layers.\1.mlp.gate.weight",
    r"blk\.(\d+)\.ffn_(gate|up|down)_shexp\.weight": r"model.layers.\1.mlp.shared_expert.\2_proj.weight",
    r"blk\.(\d+)\.ffn_gate_inp_shexp\.weight": r"model.layers.\1.mlp.shared_expert_gate.weight",
}
# a stacked experts' tensor -> the HF name of one expert's slice ({expert}: its index)
EXPERT_HF_NAMES = {
    r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight": r"model.layers.\1.mlp.experts.{expert}.\2_proj.weight",
}
# an architecture's own names, over HF_NAMES: Gemma's ffn_norm is the norm before the MLP
# (Llama's is the one after attention), and it norms each block's output again
ARCH_HF_NAMES = dict.fromkeys(("gemma2", "gemma3"), {
    r"blk\.(\d+)\.post_attention_norm\.weight": r"model.layers.\1.post_attention_layernorm.weight",
    r"blk\.(\d+)\.ffn_norm\.weight": r"model.layers.\1.pre_feedforward_layernorm.weight",
    r"blk\.(\d+)\.post_ffw_norm\.weight": r"model.layers.\1.post_feedforward_layernorm.weight",
})
# Phi-3 keeps its fused projections (split at load by the family's name map)
ARCH_HF_NAMES["phi3"] = {r"blk\.(\d+)\.attn_qkv\.weight": r"model.layers.\1.self_attn.qkv_proj.weight",
                         r"blk\.(\d+)\.ffn_up\.weight": r"model.layers.\1.mlp.gate_up_proj.weight"}
# read into the config instead: Llama 3.1's factors (checked, `_llama3_rope`), Phi-3's LongRoPE ones
IGNORED = re.compile(r"rope_freqs\.weight|rope_factors_(long|short)\.weight")


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def gguf_file(model: Path) -> Path | None:
    """The GGUF file `model` names: the file itself, or the only one in a directory without
    config.json."""
    if is_gguf(model):
        return model
    if model.is_dir() and not (model / "config.json").is_file():
        files = sorted(model.glob("*.gguf"))
        if len(files) > 1:
            raise ValueError(f"{model} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}): "
                             "name one")
        return files[0] if files else None
    return None


@functools.cache
def _reader(path: Path):
    from gguf import GGUFReader

    return GGUFReader(path)


class Tensor(NamedTuple):
    """A tensor of a GGUF file, its data a view of the file's memory map."""

    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # F32 and F16: the values in their logical shape; other types: their bytes, by row
    n_bytes: int


# GGUF's metadata value types of a fixed size (by type id): what `tensors` steps over
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _ALIGNMENT = 8, 9, 32


def tensors(path: Path) -> tuple[Tensor, ...]:
    """The file's tensors, from its header read here (GGUF v2 and v3, little-endian): gguf's reader
    also decodes every metadata value, a vocabulary's 100 k strings among them (seconds), which
    loading the weights does not need."""
    return _header(path)[1]


def architecture(path: Path) -> str | None:
    """The file's general.architecture, from its header as `tensors` reads it."""
    return _header(path)[0]


@functools.cache
def _header(path: Path) -> tuple[str | None, tuple[Tensor, ...]]:
    """(general.architecture, the tensors): see `tensors`."""
    data = np.memmap(path, mode="r")
    view = memoryview(data)
    magic, version, count, kv_count = struct.unpack_from("<4sIQQ", view, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path} is not a little-endian GGUF file of version 2 or 3")
    offset, alignment, arch = 24, _ALIGNMENT, None

    def string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", view, at)
        return bytes(view[at + 8:at + 8 + length]).decode(), at + 8 + length

    def skip(kind: int, at: int) -> int:
        if kind == _STRING:
            return at + 8 + struct.unpack_from("<Q", view, at)[0]
        if kind != _ARRAY:
            return at + _VALUE_SIZES[kind]
        item, items = struct.unpack_from("<IQ", view, at)
        at += 12
        if item != _STRING and item != _ARRAY:
            return at + items * _VALUE_SIZES[item]
        for _ in range(items):
            at = skip(item, at)
        return at

    for _ in range(kv_count):
        key, offset = string(offset)
        (kind,) = struct.unpack_from("<I", view, offset)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", view, offset + 4)
        elif key == "general.architecture" and kind == _STRING:
            arch = string(offset + 4)[0]
        offset = skip(kind, offset + 4)
    infos = []
    for _ in range(count):
        name, offset = string(offset)
        (dims,) = struct.unpack_from("<I", view, offset)
        shape = struct.unpack_from(f"<{dims}Q", view, offset + 4)
        kind, start = struct.unpack_from("<IQ", view, offset + 4 + 8 * dims)
        infos.append((name, GGMLQuantizationType(kind), tuple(reversed(shape)), start))
        offset += 4 + 8 * dims + 12
    base = -(-offset // alignment) * alignment
    out = []
    for name, kind, shape, start in infos:
        block, size = GGML_QUANT_SIZES[kind]
        n_bytes = math.prod(shape) * size // block
        raw = data[base + start:base + start + n_bytes]
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            value = raw.view(np.float32 if kind == GGMLQuantizationType.F32 else np.float16).reshape(shape)
        else:
            value = raw.reshape(quant_shape_to_byte_shape(shape, kind))
        out.append(Tensor(name, kind, value, n_bytes))
    return arch, tuple(out)


def metadata(path: Path) -> dict:
    """The file's key-value metadata (arrays of tokens and merges included)."""
    return {key: field.contents() for key, field in _reader(path).fields.items()}


def hf_config(path: Path) -> dict:
    """config.json's fields from the file's metadata."""
    meta = metadata(path)
    arch = meta["general.architecture"]
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} in {path} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    names = {t.name for t in tensors(path)}
    experts = get("expert_count", 0)
    config = {
        "architectures": [WITH_EXPERTS.get(arch, ARCHITECTURES[arch]) if experts else ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": get("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": get("embedding_length"), "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", get("embedding_length") // heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0), "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": get("rope.scaling.factor", 1.0),
                                  "original_max_position_embeddings": get("rope.scaling.original_context_length")}
    if "rope_freqs.weight" in names:
        config["rope_scaling"] = _llama3_rope(path, config)
    if arch == "qwen2":
        config["attention_bias"] = False  # (Qwen2's q/k/v biases come with the architecture)
    if experts and get("expert_gating_func", SOFTMAX_GATING) != SOFTMAX_GATING:
        raise ValueError(f"{path}: expert_gating_func {get('expert_gating_func')} is not supported (only softmax "
                         f"routing, {SOFTMAX_GATING})")
    if experts:
        config.update(num_experts=experts, num_experts_per_tok=get("expert_used_count"),
                      moe_intermediate_size=get("expert_feed_forward_length", config["intermediate_size"]),
                      shared_expert_intermediate_size=get("expert_shared_feed_forward_length", 0),
                      qkv_bias=any(name.endswith("attn_q.bias") for name in names),
                      # as the file says; else as llama.cpp does: Qwen3-MoE's top-k weights
                      # renormalised, never Qwen2-MoE's
                      norm_topk_prob=bool(get("expert_weights_norm", arch == "qwen3moe")),
                      # layers whose feed-forward tensors are a dense MLP's, not stacked experts
                      mlp_only_layers=[i for i in range(config["num_hidden_layers"])
                                       if f"blk.{i}.ffn_gate_exps.weight" not in names])
    if arch in ("gemma2", "gemma3"):
        config.update(_gemma_config(arch, get, config))
    if arch == "phi3":
        config.update(_phi3_config(path, get, config))
    return config


# Gemma's layer counts of its 27B models: llama.cpp scales their attention by hidden / heads, every
# other size's by head_dim (query_pre_attn_scalar, which the file does not hold)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_config(arch: str, get, config: dict) -> dict:
    """Gemma's fields as llama.cpp reads the file. What the file does not hold, llama.cpp fixes per
    architecture: the layer pattern (Gemma 2 alternates, even layers local; Gemma 3 makes every
    6th layer global), the attention scale, Gemma 3's local rope base (10000 unless given) and
    Gemma 2's soft-caps (50 and 30 unless given)."""
    layers, every = config["num_hidden_layers"], 2 if arch == "gemma2" else 6
    scalar = (config["hidden_size"] // config["num_attention_heads"] if layers == GEMMA_27B_LAYERS[arch]
              else config["head_dim"])
    out = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
           "query_pre_attn_scalar": scalar, "sliding_window": get("attention.sliding_window", 4096),
           "layer_types": ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)],
           "final_logit_softcapping": get("final_logit_softcapping", 30.0 if arch == "gemma2" else None)}
    if arch == "gemma2":
        out["attn_logit_softcapping"] = get("attn_logit_softcapping", 50.0)
    else:
        out["rope_local_base_freq"] = get("rope.freq_base_swa", 10000.0)
    return out


def _phi3_config(path: Path, get, config: dict) -> dict:
    """Phi-3's fields as llama.cpp's converter writes them: the rotated dimensions, a window of 0 for
    none, and LongRoPE's factors as tensors beside its original context and attention factor."""
    out = {"partial_rotary_factor": get("rope.dimension_count", config["head_dim"]) / config["head_dim"],
           "sliding_window": get("attention.sliding_window") or None}
    factors = {t.name: np.asarray(t.data, np.float32).tolist() for t in tensors(path)
               if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    if factors:
        out["rope_scaling"] = {"rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
                               "short_factor": factors["rope_factors_short.weight"],
                               "original_max_position_embeddings": get("rope.scaling.original_context_length"),
                               "attention_factor": get("rope.scaling.attn_factor")}
    return out


def _llama3_rope(path: Path, config: dict) -> dict:
    """Llama 3.1's rope scaling, which llama.cpp keeps as a tensor of frequency factors: recognised
    by recomputing them from Llama 3's published parameters (any other factors are an error)."""
    freqs = next(t for t in tensors(path) if t.name == "rope_freqs.weight")
    factors = np.asarray(freqs.data, np.float32)
    dim, theta = config["head_dim"], config["rope_theta"]
    wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    factor, low, high, original = float(factors.max()), 1.0, 4.0, 8192
    smooth = np.clip((original / wavelen - low) / (high - low), 0, 1)
    expected = np.where(wavelen < original / high, 1.0,
                        np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    if not np.allclose(factors, expected, rtol=1e-3):
        raise ValueError(f"{path}: rope_freqs.weight is not Llama 3's rope scaling, which is all that is supported")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": original}


def model_view(path: Path) -> Path:
    """A model directory for the GGUF file `path` (see the top), written into the cache on first use."""
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(repr((str(path), stat.st_size, stat.st_mtime_ns, VIEW_VERSION)).encode()).hexdigest()[:16]
    view = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (view / VIEW_MARKER).is_file():
        return view
    view.parent.mkdir(parents=True, exist_ok=True)
    log.info("reading the config and tokenizer of %s (once: kept in %s)", path.name, view)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(dir=view.parent, prefix=".view-"))
    try:
        config = hf_config(path)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": _end_of_generation(path)}
        (tmp / "generation_config.json").write_text(json.dumps(
            {k: v for k, v in generation.items() if v not in (None, [])}, indent=2))
        _write_tokenizer(path, tmp)
        (tmp / VIEW_MARKER).write_text(json.dumps({"file": str(path)}, indent=2))
        try:
            tmp.rename(view)  # atomic; a concurrent writer may have won the race
        except OSError:
            if not (view / VIEW_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _reader.cache_clear()  # (its memory map and every metadata value: the view holds what serving needs)
    log.info("read %s's config and tokenizer in %.1f s", path.name, time.monotonic() - started)
    return view


def _write_tokenizer(path: Path, out: Path) -> None:
    """The file's tokenizer (`gguf_tokenizer`) with its chat template, as tokenizer files."""
    gguf_tokenizer(path).save_pretrained(str(out))


# the tokenizer's special tokens -> the metadata key of their id (under tokenizer.ggml.)
SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                     "pad_token": "padding_token_id"}


def gguf_tokenizer(path: Path):
    """The tokenizer the file's metadata describes: its vocabulary, merges or scores, token types and
    pre-tokenizer type go to transformers' GGUF converter (which needs no torch, unlike transformers'
    GGUF file reader), and its special tokens, add_bos/add_eos flags and chat template to the
    tokenizer's settings, as transformers reads them."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    meta = metadata(path)
    fields, settings = ({name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
                        for renames in (GGUF_TOKENIZER_MAPPING["tokenizer"], GGUF_TOKENIZER_MAPPING["tokenizer_config"]))
    if fields.get("tokenizer_type") == "llama":  # (llama.cpp adds BOS to a SentencePiece vocabulary unless told not to)
        settings.setdefault("add_bos_token", True)
    for name, key in SPECIAL_TOKEN_IDS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        settings[name] = fields["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], fields)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **settings, **extra)


def _end_of_generation(path: Path) -> list[int]:
    """The ids generation stops at, as llama.cpp takes them: the file's eos, eot and eom tokens, and
    the tokens whose text ends a turn (END_OF_TURN; a Gemma 3 or Phi-3 file names only its eos)."""
    meta = metadata(path)
    ids = [meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    ids += [i for i, text in enumerate(meta.get("tokenizer.ggml.tokens", ())) if text in END_OF_TURN]
    return list(dict.fromkeys(i for i in ids if i is not None))


def view_file(model_dir: str | Path) -> Path | None:
    """The GGUF file a model view points at, or None for any other directory."""
    marker = Path(model_dir) / VIEW_MARKER
    return Path(json.loads(marker.read_text())["file"]) if marker.is_file() else None


def tensor_formats(model_dir: str | Path, name_map) -> dict[str, str]:
    """Parameter path -> the format its tensor is kept in when the view's file decides (KEPT_AS);
    float tensors are left out. `name_map`: HF name pattern -> parameter path (the family's)."""
    out = {}
    path = view_file(model_dir)
    arch = architecture(path)
    for tensor in tensors(path):
        param = _param_path(tensor.name, name_map, arch)
        if param is None and _is_experts(tensor.name):
            param = _param_path(tensor.name, name_map, arch, expert=0)
        kind = tensor.tensor_type.name
        if param is not None and kind in KEPT_AS:
            out.update(dict.fromkeys(param_paths(param), KEPT_AS[kind]))
    return out


def _is_experts(name: str) -> bool:
    return any(re.fullmatch(pattern, name) for pattern in EXPERT_HF_NAMES)


def _param_path(name: str, name_map, arch: str, expert: int | None = None) -> str | None:
    """The parameter path of the tensor `name` of a file of `arch` (with `expert`: of that expert's
    slice of a stacked one)."""
    # (an architecture's own names first: the first pattern that matches wins)
    names = [*ARCH_HF_NAMES.get(arch, {}).items(), *HF_NAMES.items()] if expert is None else EXPERT_HF_NAMES.items()
    for pattern, hf in names:
        if re.fullmatch(pattern, name):
            hf_name = re.sub(pattern, hf, name).format(expert=expert)
            return next((re.sub(p, to, hf_name) for p, to in name_map.items() if re.fullmatch(p, hf_name)), None)
    return None


def load_gguf_params(model_dir: str | Path, target: ParamTarget, dtype: str) -> dict:
    """Every tensor of the view's GGUF file, by parameter path, in the format `target` keeps it in
    (quantized parts under their own paths, see `ParamTarget.put`)."""
    path = view_file(model_dir)
    arch = architecture(path)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    loaded: dict = {}
    requantized: dict[str, set] = {}
    for tensor in tensors(path):
        kind = tensor.tensor_type.name
        if IGNORED.fullmatch(tensor.name):
            continue
        if kind not in SUPPORTED_TYPES:
            raise ValueError(f"tensor {tensor.name!r} of {path} is of type {kind}, which is not supported; "
                             f"supported: {', '.join(SUPPORTED_TYPES)}")
        experts = _is_experts(tensor.name)
        param = _param_path(tensor.name, target.hf_name_map, arch, expert=0 if experts else None)
        if param is None:
            raise ValueError(f"unexpected tensor {tensor.name!r} in {path} for a {target.architecture} model")
        if param in target.unused:
            continue
        fmt = target.formats.get(param_paths(param)[0])  # (a fused tensor's pieces share its format)
        if fmt is not None and DIRECT.get(kind) == fmt:
            value = _blocks(tensor, kind)
        else:
            value = _dequantized(tensor)
            if fmt is not None:
                requantized.setdefault(f"{kind} -> {fmt}", set()).add(tensor.name)
        if arch in NORMS_PLUS_ONE and tensor.name.endswith("norm.weight"):
            value = value - 1.0
        if arch in PERMUTED_QK and re.search(r"attn_[qk]\.", tensor.name):
            heads = config["num_attention_heads" if ".attn_q." in tensor.name else "num_key_value_heads"]
            value = _unpermute(value, heads)
        source = f"{tensor.name!r} of {path}"
        if experts:
            for e in range(_leading(value)):
                target.put(loaded, _param_path(tensor.name, target.hf_name_map, arch, expert=e), _index(value, e), dtype,
                           source=f"expert {e} of {source}")
            continue
        if tensor.name.endswith("ffn_gate_inp_shexp.weight"):  # (llama.cpp may write the [1, hidden] gate as a vector)
            value = value.reshape(1, -1)
        target.put(loaded, param, value, dtype, source=source)
    for change, names in requantized.items():
        log.info("GGUF %s: %d tensors dequantized and quantized again (%s)", change, len(names),
                 ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else ""))
    target.check_complete(loaded, path)
    _header.cache_clear()  # (its memory map: what the weights need was copied out)
    return loaded


def _leading(value) -> int:
    return (value.data if isinstance(value, QuantizedWeight) else value).shape[0]


def _index(value, i: int):
    """Slice i (along the first dimension) of an array or of quantized blocks."""
    if isinstance(value, QuantizedWeight):
        return QuantizedWeight(*(None if part is None else part[i] for part in value))
    return value[i]


def _dequantized(tensor) -> np.ndarray:
    """A tensor as float32 in its logical shape ([out, in] for a matrix)."""
    from gguf.quants import dequantize

    kind = tensor.tensor_type
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(tensor.data, np.float32)
    return dequantize(tensor.data, kind).astype(np.float32, copy=False)


def _blocks(tensor, kind: str) -> QuantizedWeight:
    """The blocks of a tensor of a DIRECT type (uint8 rows [..., out, bytes]: stacked experts have a
    leading dimension) as a QuantizedWeight."""
    data = np.asarray(tensor.data)
    lead = data.shape[:-1]
    width = {"Q8_0": 2 + BLOCK, "Q5_0": 2 + 4 + BLOCK // 2, "Q4_0": 2 + BLOCK // 2, "Q4_1": 4 + BLOCK // 2}[kind]
    blocks = data.reshape(*lead, -1, width)
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]  # every type's first field
    if kind == "Q5_0":  # its values, read through the dequantized tensor: exact multiples of the scale
        values = _dequantized(tensor).reshape(*lead, -1, BLOCK) / np.where(scales == 0, 1, scales)[..., None]
        return QuantizedWeight(np.rint(values).astype(np.int8).reshape(*lead, -1), scales)
    values = np.ascontiguousarray(blocks[..., width - (BLOCK if kind == "Q8_0" else BLOCK // 2):]).reshape(*lead, -1)
    if kind == "Q8_0":
        return QuantizedWeight(values.view(np.int8), scales)
    mins = (np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0] if kind == "Q4_1"
            else (-8 * scales).astype(np.float16))
    return QuantizedWeight(values, scales, mins)


def _unpermute(value, heads: int):
    """Undo llama.cpp's interleaving of each head's rows (for its rope layout) on q and k: a row
    permutation, so the rows of quantized blocks move as they are."""
    def rows(a: np.ndarray) -> np.ndarray:
        return a.reshape(heads, a.shape[0] // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

    if isinstance(value, QuantizedWeight):
        return QuantizedWeight(*(None if part is None else rows(part) for part in value))
    return rows(value)
