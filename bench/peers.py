"""The peers of the benchmark, installed from the package registries into a cache outside the repo.

    python bench/peers.py            # build llama-server (about 15 min on 2 cores, once)

llama.cpp comes from the llama-cpp-python source distribution on PyPI, which vendors it: a CMake
Release build of `llama-server`, and its `convert_hf_to_gguf.py` (with the `gguf` package from the
same tree) for the GGUF files. Nothing of it is committed; everything lives under CACHE.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

CACHE = Path(os.environ.get("JAXSERVE_BENCH_CACHE", Path.home() / ".cache" / "jaxserve-bench"))
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"


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


if __name__ == "__main__":
    print(llama_server())
