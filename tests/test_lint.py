"""Ruff keeps the notebook and the tests clean (it reads .ipynb files directly)."""

import subprocess
import sys

from conftest import REPO

RUFF = [sys.executable, "-m", "ruff"]
TARGETS = ["te_fp8_training.ipynb", "tests"]
OPTIONS = ["--line-length", "100"]


def test_ruff_check():
    subprocess.run(
        [*RUFF, "check", *OPTIONS, "--select", "E,F,W,I,B,UP", *TARGETS], cwd=REPO, check=True
    )


def test_ruff_format():
    subprocess.run([*RUFF, "format", "--check", *OPTIONS, *TARGETS], cwd=REPO, check=True)
