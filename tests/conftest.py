"""Shared fixtures: the notebook's definition cells, loaded as a module."""

import json
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "te_fp8_training.ipynb"


def notebook_cells(tag=None):
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    return [c for c in cells if tag is None or tag in c["metadata"].get("tags", [])]


def load_notebook_definitions():
    """Execute the cells tagged `defs` (imports, constants, functions, classes) as a module."""
    module = types.ModuleType("te_fp8_training")
    sys.modules[module.__name__] = module  # dataclasses look their module up here
    for index, cell in enumerate(notebook_cells("defs")):
        source = "".join(cell["source"])
        exec(compile(source, f"{NOTEBOOK.name}[defs {index}]", "exec"), module.__dict__)
    return module


@pytest.fixture(scope="session")
def nb():
    return load_notebook_definitions()


@pytest.fixture
def cfg(nb):
    """A small, valid configuration (the notebook's defaults, scaled down)."""
    return nb.RunConfig(
        precision="auto",
        seed=0,
        vocab_size=50,
        max_stride=4,
        seq_len=32,
        d_model=64,
        n_layers=2,
        n_heads=4,
        ffn_hidden=128,
        batch_size=16,
        train_steps=10,
        learning_rate=2e-3,
        fp8_format="HYBRID",
        amax_history_len=16,
        amax_compute_algo="max",
        fp8_margin=0,
        eval_prompts=16,
        prompt_len=4,
        gen_tokens=8,
    )
