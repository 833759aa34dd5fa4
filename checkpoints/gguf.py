"""GGUF files (llama.cpp's format) -> a model directory and the model's parameters.

A GGUF file holds the config, the tokenizer, the chat template and the weights. `model_view`
writes what the rest of jaxserve reads from a Hugging Face directory (config.json,
generation_config.json, the tokenizer files, made by transformers from the file's metadata) once
into the cache, beside a pointer to the file (VIEW_MARKER); `load_gguf_params` reads the tensors
from the file itself (`gguf`, llama.cpp's own reader, memory maps it).

A tensor goes to the format its parameter is kept in (`ParamTarget.formats`): blocks of Q8_0,
Q4_0 and Q4_1 are the int8 and int4 formats of `jaxserve_kernels.matmul.quant` as they lie; other types
are dequantized, then quantized again where kept quantized, or cast to the float dtype.

A Mixture-of-Experts layer's experts lie stacked in one tensor per projection, [experts, out, in]
(`blk.N.ffn_gate_exps`): each expert's slice loads under its Hugging Face name (`EXPERT_HF_NAMES`),
quantized blocks as they lie. Mixtral is GGUF architecture `llama` with an expert count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from checkpoints.gguf_file import architecture, header, reader, tensors
from checkpoints.gguf_metadata import NORMS_PLUS_ONE, end_of_generation, hf_config, write_tokenizer
from checkpoints.target import ParamTarget, param_paths
from jaxserve_kernels.cache import cache_root
from jaxserve_kernels.matmul.quant import BLOCK, QuantizedWeight

log = logging.getLogger(__name__)

VIEW_MARKER = "gguf.json"  # in a model view: {"file": the GGUF file}
VIEW_VERSION = 3  # bump when the files a view holds change
# llama.cpp's converter interleaves the two halves of each head's q and k rows for these (its rope layout)
PERMUTED_QK = ("llama",)
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
        generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": end_of_generation(path)}
        (tmp / "generation_config.json").write_text(json.dumps(
            {k: v for k, v in generation.items() if v not in (None, [])}, indent=2))
        write_tokenizer(path, tmp)
        (tmp / VIEW_MARKER).write_text(json.dumps({"file": str(path)}, indent=2))
        try:
            tmp.rename(view)  # atomic; a concurrent writer may have won the race
        except OSError:
            if not (view / VIEW_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    reader.cache_clear()  # (its memory map and every metadata value: the view holds what serving needs)
    log.info("read %s's config and tokenizer in %.1f s", path.name, time.monotonic() - started)
    return view


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
    header.cache_clear()  # (its memory map: what the weights need was copied out)
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
