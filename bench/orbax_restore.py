"""Restore time of the built-in model: HF safetensors load vs Orbax restore, side by side in one run.

    python bench/orbax_restore.py [--model DIR] [--runs 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax

from checkpoints import resolve_model
from jaxserve.models.config import ModelConfig
from jaxserve.worker.sharding import make_mesh
from jaxserve.worker.weights import convert_checkpoint, load_weights


def timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(jax.tree.leaves(fn()[1]))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="jaxserve-tiny")
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    hf_dir = resolve_model(args.model)
    cfg = ModelConfig.from_hf(hf_dir)
    mesh = make_mesh(len(jax.devices()))
    with tempfile.TemporaryDirectory() as tmp:
        orbax_dir = convert_checkpoint(hf_dir, f"{tmp}/orbax")
        print(f"# {hf_dir.name}, {len(jax.devices())} {jax.default_backend()} device(s)")
        print("| run | HF safetensors load (s) | Orbax restore (s) | ratio (Orbax / HF) |")
        print("| --- | --- | --- | --- |")
        for run in range(1, args.runs + 1):
            hf = timed(lambda: load_weights(hf_dir, cfg, "float32", mesh))  # (HF safetensors)
            ob = timed(lambda: load_weights(orbax_dir, cfg, "float32", mesh))  # (Orbax restore)
            print(f"| {run} | {hf:.3f} | {ob:.3f} | {ob / hf:.2f} |", flush=True)


if __name__ == "__main__":
    main()
