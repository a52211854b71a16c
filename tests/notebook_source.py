"""The notebook as the tests read it: its cells, its parameters, and its definitions as a module."""

import hashlib
import json
import linecache
import re
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "te_fp8_training.ipynb"
README = REPO / "README.md"
LESSON = REPO / "fp8_lesson.py"  # what a default Run all writes in 10.9, shipped for readers


def notebook_cells(tag=None):
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    return [c for c in cells if tag is None or tag in c["metadata"].get("tags", [])]


def source(cell):
    return "".join(cell["source"])


def outputs_text(cells):
    """What the code cells printed, an entry per stream, error and value shown."""
    out = []
    for cell in cells:
        for output in cell.get("outputs", []) if cell["cell_type"] == "code" else ():
            out.append("".join(output.get("text", "")) + output.get("evalue", ""))
            out.append("".join(output.get("data", {}).get("text/plain", "")))
    return out


def code_sha256(cells):
    """The hash of the code cells' sources, in order: what a set of saved outputs was run from."""
    code = [source(c) for c in cells if c["cell_type"] == "code"]
    return hashlib.sha256(json.dumps(code).encode()).hexdigest()


def stated_run_seconds(text):
    """The run time a text states, as "**N s**" (the introduction and the README each state one)."""
    (seconds,) = re.findall(r"\*\*(\d+) s\*\*", text)
    return int(seconds)


def notebook_parameters():
    """The parameters cell's names and default values."""
    values = {}
    exec(source(notebook_cells("parameters")[0]), values)  # noqa: S102 our own cell
    return {k: v for k, v in values.items() if not k.startswith("__")}


def load_notebook_definitions():
    """Execute the cells tagged `defs` (imports, constants, functions, classes) as a module."""
    module = types.ModuleType("te_fp8_training")
    sys.modules[module.__name__] = module  # dataclasses look their module up here
    for index, cell in enumerate(notebook_cells("defs")):
        name, text = f"{NOTEBOOK.name}[defs {index}]", source(cell)
        lines = [line + "\n" for line in text.splitlines()]  # as IPython keeps a cell's lines
        linecache.cache[name] = (len(text), None, lines, name)
        exec(compile(text, name, "exec"), module.__dict__)  # noqa: S102
    return module


def write_cell_file(name, folder):
    """The file a `%%writefile name` cell writes, written into folder as the cell does: its path."""
    magic = f"%%writefile {name}\n"
    (text,) = [source(c) for c in notebook_cells() if source(c).startswith(magic)]
    path = Path(folder) / name
    path.write_text(text.split("\n", 1)[1].rstrip("\n") + "\n")  # IPython ends a cell with one
    return str(path)


def markdown_cell(start):
    """The Markdown cell whose text starts with `start` (a section's title)."""
    cells = notebook_cells()
    (text,) = [
        source(c) for c in cells if c["cell_type"] == "markdown" and source(c).startswith(start)
    ]
    return text


def markdown_table(header, text):
    """The rows, as tuples of their cells, of the Markdown table in `text` under `header`."""
    lines = text[text.index(header) :].split("\n\n")[0].splitlines()[2:]  # past the --- line
    return [tuple(cell.strip() for cell in line.strip("|").split("|")) for line in lines]
