"""Convert a Hugging Face checkpoint (or a GGUF file) to an Orbax one that `--model` restores
straight into its mesh, quantized matrices as they are kept (`--quantization`).

    python -m jaxserve.convert --model HF_DIR --out DIR [--dtype bfloat16] [--quantization int8]
"""

from __future__ import annotations

import argparse
import time

from checkpoints import resolve_model
from jaxserve.config.checkpoint import QUANTIZATIONS
from jaxserve.worker.weights import convert_checkpoint


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint directory, GGUF file, built-in model name or hub id "
                   "(default: the default model)")
    p.add_argument("--out", required=True, help="directory to write the Orbax checkpoint to")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="as run_server.py's (default: a GGUF file's own types, others in --dtype)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    out = convert_checkpoint(resolve_model(args.model), args.out, args.dtype, args.quantization)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
