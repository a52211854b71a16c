"""The notebook as the tests read it: its cells, its parameters, and its definitions as a module."""

import json
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "te_fp8_training.ipynb"


def notebook_cells(tag=None):
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    return [c for c in cells if tag is None or tag in c["metadata"].get("tags", [])]


def notebook_parameters():
    """The parameters cell's names and default values."""
    values = {}
    exec("".join(notebook_cells("parameters")[0]["source"]), values)  # noqa: S102 our own cell
    return {k: v for k, v in values.items() if not k.startswith("__")}


def load_notebook_definitions():
    """Execute the cells tagged `defs` (imports, constants, functions, classes) as a module."""
    module = types.ModuleType("te_fp8_training")
    sys.modules[module.__name__] = module  # dataclasses look their module up here
    for index, cell in enumerate(notebook_cells("defs")):
        source = "".join(cell["source"])
        exec(compile(source, f"{NOTEBOOK.name}[defs {index}]", "exec"), module.__dict__)  # noqa: S102
    return module
