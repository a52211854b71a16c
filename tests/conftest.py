"""Shared fixtures: the notebook's definition cells, loaded as a module, and small parameters."""

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


def notebook_parameters():
    """The parameters cell's names and default values."""
    values = {}
    exec("".join(notebook_cells("parameters")[0]["source"]), values)
    return {k: v for k, v in values.items() if not k.startswith("__")}


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


@pytest.fixture(scope="session")
def defaults():
    return notebook_parameters()


@pytest.fixture
def cfg(nb, defaults):
    """A small, valid configuration: the notebook's defaults, scaled down."""
    small = {"VOCAB_SIZE": 50, "MAX_STRIDE": 4, "D_MODEL": 64, "FFN_HIDDEN": 128, "BATCH_SIZE": 16}
    small |= {"TRAIN_STEPS": 10, "SEED": 0, "EVAL_PROMPTS": 16, "PROMPT_LEN": 4, "GEN_TOKENS": 8}
    return nb.check_parameters(defaults | small)
