"""A new user's first run without torch (test-only, installed here as the reference): `run_server.py` on
the default model, with torch unimportable in the server's process and an empty cache directory that
holds only the model file a first run fetches (`tests/first_run.py`, which `.ci/run` also runs in a
virtual environment of the base install)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import DEFAULT_MODEL_NAME, builtin

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # (CI runs tests/first_run.py in the base install, without torch at all: .ci/base-serve)
def test_the_default_model_serves_with_torch_unimportable_from_an_empty_cache(tmp_path):
    fetched = builtin.fetch(DEFAULT_MODEL_NAME)
    home = tmp_path / "home"
    (home / ".cache" / "jaxserve" / "models").mkdir(parents=True)
    shutil.copy(fetched, home / ".cache" / "jaxserve" / "models" / fetched.name)
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    out = subprocess.run([sys.executable, "tests/first_run.py", "--block", "torch"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-5000:]
    timeline = json.loads(out.stdout.strip().splitlines()[-1])
    assert timeline["first_answer_s"] > timeline["health_200_s"]
    # (the view was built here, with torch blocked: nothing came from the machine's own cache)
    assert next((home / ".cache" / "jaxserve" / "gguf").glob("*/tokenizer.json"), None) is not None
