"""Run a notebook's code cells, in order, up to and including the one that imports TE.

This is what Run all does on Colab before anything else, with one difference: this machine has
no GPU, so "a CUDA device of compute capability 8.9 (an L4) exists" is patched in. Nothing else
is: the install runs pip and the compiler for real, and the import is TE's own.

    [TE_WHEEL_DIR=FOLDER] python run_cells.py NOTEBOOK

With TE_WHEEL_DIR set, the notebook's parameter of that name is set to it, as papermill's -p
would set it, right after the parameters cell.
"""

import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch

TE_IMPORT = "import transformer_engine.pytorch as te"


def cells_through_te_import(path):
    for cell in json.loads(Path(path).read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code":
            yield source
            if "parameters" in cell["metadata"].get("tags", []) and "TE_WHEEL_DIR" in os.environ:
                yield f"TE_WHEEL_DIR = {os.environ['TE_WHEEL_DIR']!r}  # as papermill's -p would"
            if TE_IMPORT in source:
                return
    raise SystemExit(f"{path}: no code cell contains {TE_IMPORT!r}")


def loaded_libraries(*names):
    """The shared objects of these names mapped into this process (which cuDNN TE loaded)."""
    maps = Path("/proc/self/maps").read_text().split("\n")
    paths = {line.split()[-1] for line in maps if "/" in line}
    return sorted(p for p in paths if any(f"/{name}" in p for name in names))


namespace = {"__name__": "__main__"}
with (
    mock.patch.object(torch.cuda, "is_available", lambda: True),
    mock.patch.object(torch.cuda, "device_count", lambda: 1),
    mock.patch.object(torch.cuda, "get_device_capability", lambda *device: (8, 9)),
    mock.patch.object(torch.cuda, "get_device_name", lambda *device: "NVIDIA L4"),
):
    for index, source in enumerate(cells_through_te_import(sys.argv[1])):
        started = time.monotonic()
        print(f"--- code cell {index}", flush=True)
        exec(compile(source, f"cell {index}", "exec"), namespace)  # noqa: S102 the notebook's own
        print(f"--- code cell {index} took {time.monotonic() - started:.0f} s", flush=True)

error = namespace.get("TE_ERROR", namespace.get("TE_IMPORT_ERROR"))
print("RESULT:", f"TE did not import: {error}" if error else "TE imported")
print("cuDNN and NCCL libraries loaded:", *loaded_libraries("libcudnn", "libnccl"), sep="\n  ")
