"""Run the notebook top to bottom on this machine's CPU and save it with its outputs.

    .venv/bin/python tests/save_outputs.py

papermill runs the notebook in a scratch folder, then the executed copy replaces
te_fp8_training.ipynb: papermill's own metadata removed, and the hash of the code cells it ran
recorded in the notebook's metadata, where tests/test_notebook.py compares it with the code. The
run's own time ("Run all took N s", section 11) is written where the introduction and the README
state it; the fp8_lesson.py it wrote (10.9) replaces the shipped one. Run it after every change
to a code cell, on a CPU machine (the saved outputs are the CPU plan's).
"""

import json
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import torch
from notebook_source import LESSON, NOTEBOOK, README, code_sha256, stated_run_seconds

RUN_TOOK = re.compile(r"Run all took\s+(\d+) s")


def run_notebook(folder):
    executed = Path(folder) / "executed.ipynb"
    command = [sys.executable, "-m", "papermill", str(NOTEBOOK), str(executed), "--cwd", folder]
    subprocess.run([*command, "--no-progress-bar"], check=True)
    return nbformat.read(executed, as_version=4)


def without_papermill(nb):
    nb.metadata.pop("papermill", None)
    for cell in nb.cells:
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)
    return nb


def measured_seconds(nb):
    texts = [out.get("text", "") for cell in nb.cells for out in cell.get("outputs", [])]
    return int(next(m.group(1) for text in texts if (m := RUN_TOOK.search(text))))


def state_run_time(text, seconds):
    """The text with its stated run time (the one sentence that states it) set to `seconds`."""
    stated = stated_run_seconds(text)
    return text.replace(f"**{stated} s**", f"**{seconds} s**", 1)


def main():
    with tempfile.TemporaryDirectory() as folder:
        nb = without_papermill(run_notebook(folder))
        LESSON.write_text((Path(folder) / LESSON.name).read_text())
    seconds = measured_seconds(nb)
    intro = nb.cells[0]
    intro.source = state_run_time(intro.source, seconds)
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    nb.metadata["te_fp8_training"] = {
        "outputs_of_code_sha256": code_sha256(nb.cells),
        "outputs_from": f"Run all on a CPU ({machine}), {seconds} s",
    }
    nbformat.write(nb, NOTEBOOK)
    README.write_text(state_run_time(README.read_text(), seconds))
    size = NOTEBOOK.stat().st_size / 2**20
    print(json.dumps({"run_all_s": seconds, "file_mb": round(size, 2)}))


if __name__ == "__main__":
    main()
