"""Loading HF checkpoints: sharded files, dtypes, the default model, and clear errors."""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_models import build_hf_model, save_hf_model

from checkpoints import default_model_dir, resolve_model
from jaxserve.config.checkpoint import resolve_dtype, sampling_defaults
from jaxserve.models.config import ModelConfig
from jaxserve.worker.weights import load_weights

ROOT = Path(__file__).resolve().parent.parent


def _leaves(state):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_sharded_checkpoint_with_index_equals_single_file(hf_checkpoint, tmp_path):
    model, single = hf_checkpoint("qwen3")
    sharded = save_hf_model(model, tmp_path / "sharded", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    cfg = ModelConfig.from_hf(single)
    for a, b in zip(_leaves(load_weights(single, cfg, "float32")[1]),
                    _leaves(load_weights(sharded, cfg, "float32")[1])):
        np.testing.assert_array_equal(a, b)


def test_bfloat16_checkpoint_loads_in_either_dtype(tmp_path):
    model = build_hf_model("qwen2").to(torch.bfloat16)
    d = save_hf_model(model, tmp_path / "bf16")
    cfg = ModelConfig.from_hf(d)
    want = model.state_dict()["model.layers.1.mlp.down_proj.weight"].float().numpy()
    for dtype in ("bfloat16", "float32"):
        state = load_weights(d, cfg, dtype)[1]
        got = np.asarray(state["layers"][1]["mlp"]["down_proj"]["weight"][...], np.float32)
        np.testing.assert_array_equal(got, want)
    assert resolve_dtype("auto", d) == "bfloat16" and resolve_dtype("float32", d) == "float32"


@pytest.mark.parametrize("stored,auto", [({"torch_dtype": "float32"}, "float32"), ({"dtype": "bfloat16"}, "bfloat16"),
                                         ({"torch_dtype": "float16"}, "bfloat16"), ({}, "float32")])
def test_dtype_auto_is_the_checkpoints_own(hf_checkpoint, tmp_path, stored, auto):
    """vLLM's default dtype "auto": what config.json names (`torch_dtype`, or transformers 5's
    `dtype`); float16 runs as bfloat16, and a config that names none as float32."""
    _, src = hf_checkpoint("llama")
    cfg = {k: v for k, v in json.loads((src / "config.json").read_text()).items() if k not in ("torch_dtype", "dtype")}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **stored}))
    assert resolve_dtype("auto", tmp_path) == auto
    # vLLM's other names: float16 and half run as bfloat16, float is float32
    assert [resolve_dtype(d, tmp_path) for d in ("float16", "half", "float")] == ["bfloat16", "bfloat16", "float32"]


def _copy(src, dst, **config_changes):
    """A copy of the checkpoint `src` at `dst`, with `config_changes` written into its config.json."""
    shutil.copytree(src, dst)
    if config_changes:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config_changes}))
    return dst


def test_missing_files_are_named(hf_checkpoint, tmp_path):
    _, src = hf_checkpoint("llama")
    d = _copy(src, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_weights(d, ModelConfig.from_hf(d), "float32")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_hf(d)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        resolve_model(str(tmp_path / "nowhere"))


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelConfig.from_hf(tmp_path)


def test_unsupported_rope_type_is_refused(hf_checkpoint, tmp_path):
    _, src = hf_checkpoint("llama")
    d = _copy(src, tmp_path / "m", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf(d)


def test_shape_mismatch_names_the_tensor(hf_checkpoint, tmp_path):
    _, src = hf_checkpoint("llama")
    d = _copy(src, tmp_path / "m", intermediate_size=96)
    with pytest.raises(ValueError, match=r"model\.layers\.\d+\.mlp\.\w+_proj\.weight.*shape"):
        load_weights(d, ModelConfig.from_hf(d), "float32")


def test_missing_tensor_is_reported(tmp_path):
    model = build_hf_model("llama")
    state = {k: v for k, v in model.state_dict().items() if k != "model.norm.weight"}
    d = tmp_path / "m"
    model.save_pretrained(d, state_dict=state)
    with pytest.raises(ValueError, match="lacks 1 tensors.*norm.weight"):
        load_weights(d, ModelConfig.from_hf(d), "float32")


def test_default_model_is_real_hf_format_and_matches_transformers():
    import transformers

    d = default_model_dir()
    assert default_model_dir() == d  # generated once, then reused
    assert "Random weights" in (d / "README.md").read_text()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    text = "héllo, wörld ✓"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text and len(ids) == len(text.encode())
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    cfg = ModelConfig.from_hf(d)
    assert cfg.eos_token_ids == (259, 257)

    from test_parity import chunked_logits

    ids = np.random.default_rng(0).integers(0, 256, size=30).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(chunked_logits(d, ids, [30]), want, atol=1e-4, rtol=0)


def test_an_orbax_conversion_of_an_older_format_is_refused_with_the_fix(tmp_path):
    from checkpoints.orbax_io import MARKER

    (tmp_path / MARKER).write_text(json.dumps({"source": "/models/llama", "dtype": "float32"}))  # no format: 1
    with pytest.raises(ValueError, match=r"format 1.*convert it again: python -m jaxserve.convert --model "
                                         r"/models/llama"):
        load_weights(tmp_path, ModelConfig.from_hf(default_model_dir()), "float32")


def test_sampling_defaults_of_the_generation_config(tmp_path):
    """vLLM's --generation-config: "auto" reads the model's file, a directory another one, "vllm"
    none; only the sampling fields, max_new_tokens as max_tokens."""
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir(), other.mkdir()
    (model / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.05,
         "min_p": None, "max_new_tokens": 64, "do_sample": True}))
    (other / "generation_config.json").write_text(json.dumps({"top_k": 20}))
    assert sampling_defaults(model) == {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.05, "max_tokens": 64}
    assert sampling_defaults(model, str(other)) == {"top_k": 20}
    assert sampling_defaults(model, "vllm") == {} and sampling_defaults(other / "none") == {}
    with pytest.raises(FileNotFoundError):
        sampling_defaults(model, str(tmp_path))


def test_checkpoints_import_nothing_of_jaxserve():
    """jaxserve uses checkpoints, never the other way round: no module of checkpoints names jaxserve in
    an import, and importing them all brings in no jaxserve module."""
    for path in (ROOT / "checkpoints").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
        names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [name for name in names if name.split(".")[0] == "jaxserve"], path
    code = ("import sys, checkpoints, checkpoints.hf, checkpoints.orbax_io, checkpoints.default_model, "
            "checkpoints.byte_level, checkpoints.target; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'jaxserve'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


def test_a_target_alone_says_what_to_load(tmp_path):
    """The loaders need no model, only a ParamTarget: names mapped to paths, cast to the dtype, a
    tensor the target leaves out skipped, others refused with the target's architecture named."""
    import jax.numpy as jnp
    from safetensors.numpy import save_file

    from checkpoints import ParamTarget, load_params

    weight = np.arange(6, dtype=np.float32).reshape(2, 3)
    save_file({"a.weight": weight, "head.weight": np.ones(3, np.float32),
               "model.rotary_emb.inv_freq": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    target = ParamTarget(architecture="ToyForCausalLM", shapes={"x.w": (2, 3)},
                         hf_name_map={r"a\.weight": "x.w", r"head\.weight": "head.w"}, unused=frozenset({"head.w"}))
    params = load_params(tmp_path, target, "bfloat16")
    assert list(params) == ["x.w"] and params["x.w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(params["x.w"], np.float32), weight)
    with pytest.raises(ValueError, match="'head.weight'.*does not fit this ToyForCausalLM config"):
        load_params(tmp_path, dataclasses.replace(target, unused=frozenset()), "float32")
    with pytest.raises(ValueError, match="unexpected tensor 'head.weight'.*for a ToyForCausalLM checkpoint"):
        load_params(tmp_path, dataclasses.replace(target, hf_name_map={r"a\.weight": "x.w"}), "float32")
    with pytest.raises(ValueError, match=r"lacks 1 tensors, e\.g\. \['y\.w'\]"):
        load_params(tmp_path, dataclasses.replace(target, shapes={"x.w": (2, 3), "y.w": (1,)}), "float32")


def test_fused_tensors_split_and_expert_slices_stack(tmp_path):
    """A name map's "a|b" target splits a fused tensor's rows in the parameters' sizes (Phi-3's
    qkv_proj), "a[i]" gathers slices into a stacked parameter (experts); kept quantized, each piece
    is quantized as its own matrix. A missing slice or a wrong row count is an error."""
    from safetensors.numpy import save_file

    from checkpoints import ParamTarget, load_params
    from jaxserve_kernels.matmul.quant import QuantizedWeight, dequantize

    rng = np.random.default_rng(0)
    fused = rng.standard_normal((5, 64)).astype(np.float32)
    experts = rng.standard_normal((3, 4, 64)).astype(np.float32)
    save_file({"qkv.weight": fused, **{f"e.{i}.weight": experts[i] for i in range(3)}},
              str(tmp_path / "model.safetensors"))
    target = ParamTarget(architecture="Toy", shapes={"q.w": (3, 64), "k.w": (2, 64), "x.w": (3, 4, 64)},
                         hf_name_map={r"qkv\.weight": "q.w|k.w", r"e\.(\d+)\.weight": r"x.w[\1]"})
    params = load_params(tmp_path, target, "float32")
    np.testing.assert_array_equal(params["q.w"], fused[:3])
    np.testing.assert_array_equal(params["k.w"], fused[3:])
    np.testing.assert_array_equal(params["x.w"], experts)

    quantized = dataclasses.replace(target, shapes={**target.shapes, "x.w": (3, 4, 64), "x.scales": (3, 4, 2)},
                                    formats={"x.w": "int8"})
    params = load_params(tmp_path, quantized, "float32")
    got = dequantize(QuantizedWeight(params["x.w"], params["x.scales"], None))
    np.testing.assert_allclose(got, experts, atol=np.abs(experts).max() / 100)

    with pytest.raises(ValueError, match=r"lacks 1 slices of x\.w, e\.g\. \[2\]"):
        save_file({"e.0.weight": experts[0], "e.1.weight": experts[1]}, str(tmp_path / "model.safetensors"))
        load_params(tmp_path, dataclasses.replace(target, hf_name_map={r"e\.(\d+)\.weight": r"x.w[\1]"},
                                                  shapes={"x.w": (3, 4, 64)}), "float32")
    save_file({"qkv.weight": fused[:4]}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"has 4 rows, expected 5 \(3 \+ 2\)"):
        load_params(tmp_path, dataclasses.replace(target, shapes={"q.w": (3, 64), "k.w": (2, 64)}), "float32")
