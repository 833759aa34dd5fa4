"""Orbax checkpoints: convert a Hugging Face checkpoint once, restore it straight into a mesh.

A converted directory holds `params/` (the model's parameters, saved by Orbax, one array per
weight, quantized matrices as their parts), the HF `config.json`, `generation_config.json` and
tokenizer files (so it is a model directory like any other), and `jaxserve_orbax.json` (what made
it, and the format of each matrix kept quantized: `saved_formats`).
Restoring reads each array directly into its sharding (no full copy on one device).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax

from checkpoints.target import ParamTarget

MARKER = "jaxserve_orbax.json"
FORMAT = 2  # 2: linear weights [out, in] under `.weight` (1 stored them [in, out] under `.kernel`)
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
          "special_tokens_map.json", "chat_template.jinja", "README.md")


def is_orbax_dir(model_dir: str | Path) -> bool:
    return (Path(model_dir) / MARKER).is_file()


def saved_formats(model_dir: str | Path) -> dict[str, str]:
    """The quantized format of each matrix a converted directory keeps quantized."""
    return json.loads((Path(model_dir) / MARKER).read_text()).get("formats", {})


def convert(hf_dir: str | Path, out_dir: str | Path, target: ParamTarget, dtype: str = "float32") -> Path:
    """Write an Orbax checkpoint of the model directory `hf_dir` (HF safetensors or a GGUF view;
    weights in `dtype` and `target`'s formats, the parameters of `target`, whose sharding is not
    used) to `out_dir`."""
    import orbax.checkpoint as ocp

    from checkpoints import load_params

    hf_dir, out_dir = Path(hf_dir), Path(out_dir).resolve()
    with jax.default_device(jax.devices("cpu")[0]):  # host memory, not one accelerator's
        params = load_params(hf_dir, dataclasses.replace(target, sharding=None), dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    flat = {path.replace(".", "/"): value for path, value in params.items()}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out_dir / "params", flat, force=True)
    checkpointer.wait_until_finished()
    for name in COPIED:
        if (hf_dir / name).is_file():
            shutil.copy(hf_dir / name, out_dir / name)
    (out_dir / MARKER).write_text(json.dumps({"source": str(hf_dir), "dtype": dtype, "format": FORMAT,
                                              "formats": dict(target.formats)}, indent=2))
    return out_dir


def restore(model_dir: str | Path, target: ParamTarget, dtype: str) -> dict[str, jax.Array]:
    """The parameters of `target` from a converted directory, by path, each in `dtype` (a quantized
    part in its own) and its sharding. The target must keep the matrices quantized as they were saved."""
    import orbax.checkpoint as ocp

    made = json.loads((Path(model_dir) / MARKER).read_text())
    if made.get("format", 1) != FORMAT:
        raise ValueError(f"{model_dir} was converted by an older jaxserve (format {made.get('format', 1)}, this one "
                         f"reads {FORMAT}); convert it again: python -m jaxserve.convert --model "
                         f"{made.get('source', 'HF_DIR')} --out {model_dir}")
    if dict(target.formats) != made.get("formats", {}):
        raise ValueError(f"{model_dir} keeps {len(made.get('formats', {}))} matrices quantized as it was converted; "
                         "serve it with the quantization it was converted with, or convert it again")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = {path.replace(".", "/"): jax.ShapeDtypeStruct(
        shape, target.dtype_of(path, dtype), sharding=target.sharding(path) if target.sharding is not None else device)
        for path, shape in target.shapes.items()}
    restored = ocp.StandardCheckpointer().restore(Path(model_dir).resolve() / "params", shapes)
    return {key.replace("/", "."): value for key, value in restored.items()}
