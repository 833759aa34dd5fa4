"""--quantization int8 / int4 from float checkpoints, for every architecture, on 1 and 8 devices.

The reference is the same checkpoint with each matrix that is kept quantized replaced by its
dequantized values, in float32: both compute with the same weights, and what differs is only how
(the quantized products, on a mesh). Invariants, as for the real model (test_gguf): top-1
agreement >= 97 % and mean KL divergence <= 0.01 nats, top-1 over 120 positions less the near
ties (TIE: these random models' logits lie close together, and the CPU kernel, as llama.cpp's,
multiplies activations rounded to 8 bits, which moves logits by up to a few tenths here); a
matrix's scales are split over the mesh with its data, and replicated with it where their blocks
do not divide.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from hf_models import ARCHITECTURES
from safetensors.numpy import load_file, save_file
from conftest import needs_cpu_backend
from test_gguf import INT8_ACTIVATIONS, MAX_KL, MIN_TOP1, TIE, agreement

from checkpoints.target import param_paths
from jaxserve.models import MODEL_REGISTRY
from jaxserve.models.config import ModelConfig
from jaxserve.worker.weights import weight_formats
from jaxserve_kernels.matmul.quant import QuantizedWeight, dequantize, quantize

HERE = Path(__file__).resolve().parent


def dequantized_twin(model_dir: Path, quantization: str, out: Path) -> Path:
    """A copy of the checkpoint whose matrices kept quantized hold their dequantized values."""
    import shutil

    shutil.copytree(model_dir, out)
    cfg = ModelConfig.from_hf(model_dir)
    formats = weight_formats(model_dir, cfg, quantization)
    name_map = MODEL_REGISTRY[cfg.architecture].hf_name_map
    for file in out.glob("*.safetensors"):
        tensors = load_file(file)
        for name, tensor in tensors.items():  # (an expert's tensor maps to a slice of its stack: "a[3]")
            target = next((re.sub(p, to, name) for p, to in name_map.items() if re.fullmatch(p, name)), None)
            fmt = formats.get(param_paths(target)[0]) if target is not None else None
            if fmt is not None:
                tensors[name] = np.asarray(dequantize(quantize(tensor, fmt)), np.float32)
        save_file(tensors, str(file), metadata={"format": "pt"})
    return out


def run_worker(model_dir: Path, quantization: str, sizes: tuple[int, ...], ids: list[int]) -> dict:
    path = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": path}
    args = [sys.executable, str(HERE / "quant_worker.py"), str(model_dir), quantization,
            ",".join(map(str, sizes)), json.dumps(ids)]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900, cwd=HERE.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def check_quantized(arch: str, quantization: str, sizes: tuple[int, ...], hf_checkpoint, tmp_path,
                    model_dir: Path | None = None, bounds: tuple[float, float] = (MIN_TOP1, MAX_KL)) -> dict:
    """The module's invariants for `arch`'s tiny checkpoint (or `model_dir`, a changed copy of it):
    top-1 agreement and mean KL within `bounds`."""
    model, model_dir = hf_checkpoint(arch)[0], model_dir or hf_checkpoint(arch)[1]
    ids = np.random.default_rng(7).integers(0, model.config.get_text_config().vocab_size, size=120).tolist()
    twin = dequantized_twin(model_dir, quantization, tmp_path / "twin")
    want = np.array(run_worker(twin, "None", (1,), ids)[1]["logits"])
    results = run_worker(model_dir, quantization, sizes, ids)
    for tp, result in results.items():
        top1, kl = agreement(np.array(result["logits"]), want, TIE)
        assert top1 >= bounds[0] and kl <= bounds[1], (tp, top1, kl)
    return results


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_llama_quantized_at_load_on_8_devices(quantization, hf_checkpoint, tmp_path):
    """hidden 64 (2 blocks), intermediate 128 (4 blocks): on 8 devices up_proj is split by rows
    with its scales; down_proj's 4 blocks of input do not divide over 8, so it is replicated whole."""
    results = check_quantized("llama", quantization, (1, 8), hf_checkpoint, tmp_path)
    placed = results[8]["placed"]
    width = 128 if quantization == "int8" else 64
    assert placed["up_proj.weight"] == [[128 // 8, 64 if quantization == "int8" else 32], 8]
    assert placed["up_proj.scales"] == [[128 // 8, 2], 8]
    assert placed["down_proj.weight"] == [[64, width], 8] and placed["down_proj.scales"] == [[64, 4], 8]
    assert ("up_proj.mins" in placed) == (quantization == "int4")


# One architecture per family by default (its layers and name map: Gemma's norms and biases,
# Phi-3's split tensors, Qwen2-MoE's stacked experts and shared expert); the others, slow.
# (mixtral left out: its tiny random router's top-2 of 5 flips for some tokens under the CPU kernel's
# 8-bit activations, a jump no bound on smooth errors fits; the Qwen MoE models stay within them)
FAMILY_REPRESENTATIVES = ("qwen3", "gemma2", "phi3", "qwen2-moe")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("arch", [a if a in FAMILY_REPRESENTATIVES else pytest.param(a, marks=pytest.mark.slow)
                                  for a in ARCHITECTURES if a not in ("llama", "mixtral")])
def test_every_architecture_quantized_at_load(arch, quantization, hf_checkpoint, tmp_path):
    check_quantized(arch, quantization, (1, 8), hf_checkpoint, tmp_path)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_mixtral_quantized_at_load_with_decisive_routing(quantization, hf_checkpoint, tmp_path):
    """Mixtral, its experts kept quantized, on 1 and 8 devices. Its router's weights are scaled 8x: the
    tiny random router's top-2 of 5 otherwise flips for some tokens under 8-bit activations (see
    FAMILY_REPRESENTATIVES); with clear choices the same bounds hold where the activations are not
    rounded to int8. Where they are, a few tokens' choices still flip, each a jump of its logits:
    top-1 >= 95 % and mean KL <= 0.03 (measured: 0.97-0.99 and 0.012-0.023)."""
    import shutil

    decisive = Path(shutil.copytree(hf_checkpoint("mixtral")[1], tmp_path / "decisive"))
    for file in decisive.glob("*.safetensors"):
        tensors = {name: value * 8 if re.search(r"block_sparse_moe\.gate\.weight$|mlp\.gate\.weight$", name)
                   else value for name, value in load_file(file).items()}
        save_file(tensors, str(file), metadata={"format": "pt"})
    bounds = (0.95, 0.03) if INT8_ACTIVATIONS else (MIN_TOP1, MAX_KL)
    check_quantized("mixtral", quantization, (1, 8), hf_checkpoint, tmp_path, model_dir=decisive, bounds=bounds)


def test_weight_formats():
    """Every linear layer in the format asked for, the LM head in int8; a GGUF file's own types by
    default; none for a float checkpoint unless asked."""
    from checkpoints import default_model_dir

    d = default_model_dir()
    cfg = ModelConfig.from_hf(d)
    assert weight_formats(d, cfg, None) == weight_formats(d, cfg, "none") == {}
    formats = weight_formats(d, cfg, "int4")
    assert formats["lm_head.weight"] == "int8" and formats["layers.3.mlp.down_proj.weight"] == "int4"
    assert "embed_tokens.embedding" not in formats and len(formats) == 7 * cfg.num_layers + 1
    with pytest.raises(ValueError, match="needs a GGUF file"):
        weight_formats(d, cfg, "gguf")


def test_a_step_computes_its_padding_where_its_products_do(hf_checkpoint, monkeypatch):
    """`EngineConfig.padding_computed_from` as build_engine resolves it (`sched.limits.bucket_cut`
    reads it): on one CPU device never for quantized layers (the kernels skip a step's padding at
    every row count), past the kernel's row limit for float32 ones, and for bfloat16 ones without
    bfloat16 instructions (XLA's dot takes the products past it); from the first token for experts
    (their products run every row), on a mesh and with the "xla" implementation (XLA's dot computes
    every row)."""
    needs_cpu_backend()
    monkeypatch.delenv("JAXSERVE_MATMUL", raising=False)
    import jax.numpy as jnp

    from checkpoints import default_model_dir
    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.build import _prepare
    from jaxserve_kernels.matmul import native_bf16, padding_computed_from

    def resolved(model, **settings):
        return _prepare(EngineConfig(model=str(model), **settings), None)[2].padding_computed_from

    assert resolved(default_model_dir(), quantization="int4") is None
    assert _prepare(EngineConfig(model=str(default_model_dir())), None)[2].fine_buckets  # (on CPU)
    assert resolved(default_model_dir(), quantization="none", dtype="float32") == 65
    assert resolved(hf_checkpoint("mixtral")[1], quantization="int8") == 0
    assert padding_computed_from(jnp.bfloat16, True, 1) == (None if native_bf16() else 257)
    assert padding_computed_from(jnp.float32, False, 8) == padding_computed_from(jnp.bfloat16, True, 8) == 0
    monkeypatch.setenv("JAXSERVE_MATMUL", "xla")
    assert padding_computed_from(jnp.float32, False, 1) == 0


def test_one_cpu_device_keeps_the_linear_layers_grouped(monkeypatch):
    """On one CPU device where the kernel's integer forms run, every quantized matrix whose rows come
    in whole groups is kept grouped, a tied embedding (the LM head) too (the same weight: grouping
    the layout in rows gives it) as one array, and its module hands the kernel a GroupedRows. (This model's head
    is untied; the default model's tied one is served grouped in test_gguf.py.)"""
    from checkpoints import default_model_dir, load_params
    from checkpoints.target import quantized_paths
    from jaxserve.models import quantizable_modules
    from jaxserve.worker import weights
    from jaxserve_kernels.matmul import keeps_grouped
    from jaxserve_kernels.matmul.quant import GroupedRows, can_group, group_rows

    d = default_model_dir()
    cfg = ModelConfig.from_hf(d)
    if not keeps_grouped(1):
        pytest.skip("the kernel's integer forms do not run here")
    assert not keeps_grouped(8)
    target = weights.weight_target(d, cfg, "float32", quantization="int4")[2]
    formats = weight_formats(d, cfg, "int4")
    assert target.grouped == {p for p in formats if can_group(target.shapes[p])}
    assert "layers.0.mlp.up_proj.weight" in target.grouped
    grouped = load_params(d, target, "float32")
    model = nnx.merge(*weights.load_weights(d, cfg, "float32", quantization="int4"))
    for path, module in quantizable_modules(model).items():
        assert isinstance(module.matrix(), GroupedRows) == (f"{path}.{module.WEIGHT}" in target.grouped)
    monkeypatch.setattr(weights, "keeps_grouped", lambda devices: False)
    rows = load_params(d, weights.weight_target(d, cfg, "float32", quantization="int4")[2], "float32")
    for path in target.grouped:  # (one array at the weight's path, its scales' and mins' paths gone)
        parts = quantized_paths(path)
        want = group_rows(QuantizedWeight(*(np.asarray(rows[p]) for p in parts)))
        np.testing.assert_array_equal(np.asarray(grouped[path]), want.data)
        assert not set(parts[1:]) & set(grouped)


def test_an_orbax_copy_keeps_the_matrices_quantized(tmp_path):
    """Converted with --quantization int4, restored as it was converted (and nothing else)."""
    import jax

    from checkpoints import default_model_dir
    from jaxserve.worker.weights import convert_checkpoint, load_weights

    d = default_model_dir()
    cfg = ModelConfig.from_hf(d)
    out = convert_checkpoint(d, tmp_path / "orbax", "float32", "int4")
    _, want = load_weights(d, cfg, "float32", quantization="int4")
    _, got = load_weights(out, cfg, "float32")
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert got["layers"][0]["mlp"]["up_proj"]["weight"][...].dtype == np.uint8
    with pytest.raises(ValueError, match="quantization it was converted with"):
        load_weights(out, cfg, "float32", quantization="int8")


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_products_lower_for_tpu_and_gpu(platform, fmt):
    """Lowered from this CPU: the weight enters the step as its int8 / packed uint8 blocks (it stays
    at its quantized size in device memory) and is converted next to the bfloat16 product, which
    XLA fuses into the dot."""
    import jax
    import jax.numpy as jnp

    from jaxserve_kernels import matmul_t

    w = quantize(np.random.default_rng(0).normal(size=(96, 128)).astype(np.float32), fmt)
    x = jnp.ones((4, 128), jnp.bfloat16)
    # (impl: what those backends run; traced on this CPU, the default would be the CPU kernel)
    text = jax.jit(functools.partial(matmul_t, impl="xla")).trace(x, w).lower(lowering_platforms=(platform,)).as_text()
    data_type = "i8" if fmt == "int8" else "ui8"
    assert f"tensor<96x{128 if fmt == 'int8' else 64}x{data_type}>" in text.split("\n", 3)[1]  # an argument
    assert "stablehlo.dot_general" in text and "tensor<96x128xbf16>" in text
