"""Convert a Hugging Face checkpoint to an Orbax one that `--model` restores straight into its mesh.

    python -m jaxserve.convert --model HF_DIR --out DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

from checkpoints import resolve_model
from jaxserve.weights import convert_checkpoint


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint directory or hub id (default: jaxserve-tiny)")
    p.add_argument("--out", required=True, help="directory to write the Orbax checkpoint to")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    start = time.perf_counter()
    out = convert_checkpoint(resolve_model(args.model), args.out, args.dtype)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
