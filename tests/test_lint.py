"""Ruff keeps the notebook and the tests clean (it reads .ipynb files directly).

The settings live in .ruff.toml, so plain `ruff check` and `ruff format` agree with these tests.
"""

import subprocess
import sys

from notebook_source import REPO

RUFF = [sys.executable, "-m", "ruff"]
TARGETS = ["te_fp8_training.ipynb", "tests"]


def test_ruff_check():
    subprocess.run([*RUFF, "check", "--no-cache", *TARGETS], cwd=REPO, check=True)


def test_ruff_format():
    subprocess.run([*RUFF, "format", "--check", "--no-cache", *TARGETS], cwd=REPO, check=True)
