"""``flashinfra generate --image`` on the built-in default model (its vision tower is tiny and untrained):
it runs end to end, and a bad file is a clean error."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np


def _run(tmp_path, *args):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "flashinfra", "generate", "--max-tokens", "8", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_generate_with_an_image(tmp_path):
    from PIL import Image

    path = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 80, 3), dtype=np.uint8)).save(path)
    out = _run(tmp_path, "--image", str(path), "Describe:")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Describe:") and len(out.stdout.strip()) > len("Describe:")
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    err = _run(tmp_path, "--image", str(bad), "Describe:")
    assert err.returncode != 0 and "not a readable image" in err.stderr
