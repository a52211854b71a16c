"""The notebook as a whole: its structure, and a real headless run on CPU."""

import ast
import json
import math
import re
import subprocess
import sys

import pytest
from conftest import NOTEBOOK, REPO, notebook_cells

PARAMETERS = (
    "PRECISION SEED VOCAB_SIZE MAX_STRIDE SEQ_LEN D_MODEL N_LAYERS N_HEADS FFN_HIDDEN BATCH_SIZE "
    "TRAIN_STEPS LEARNING_RATE FP8_FORMAT AMAX_HISTORY_LEN AMAX_COMPUTE_ALGO FP8_MARGIN "
    "EVAL_PROMPTS PROMPT_LEN GEN_TOKENS RESULTS_JSON"
).split()

# Small enough for CI, large enough to learn the task.
SMALL = {"TRAIN_STEPS": 200, "D_MODEL": 64, "FFN_HIDDEN": 256, "EVAL_PROMPTS": 64}


def test_one_parameters_cell_defines_exactly_the_documented_names():
    cells = notebook_cells("parameters")
    assert len(cells) == 1
    tree = ast.parse("".join(cells[0]["source"]))
    assigned = [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets]
    assert assigned == PARAMETERS


def test_definition_cells_do_not_read_the_parameters():
    """Functions take a RunConfig, so tests and users can call them with any values."""
    for cell in notebook_cells("defs"):
        names = {
            n.id for n in ast.walk(ast.parse("".join(cell["source"]))) if isinstance(n, ast.Name)
        }
        assert not names & set(PARAMETERS), names & set(PARAMETERS)


def test_saved_notebook_has_no_outputs():
    """Outputs would have to come from a run of exactly this code; we keep none."""
    for cell in notebook_cells():
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)```", readme, re.S)
    test_command = next(c.strip() for c in commands if "pytest" in c)
    assert test_command in (REPO / ".ci" / "run").read_text()


@pytest.fixture(scope="module")
def headless_run(tmp_path_factory):
    """Execute the notebook top to bottom with papermill, small parameters, on CPU."""
    out = tmp_path_factory.mktemp("run")
    results = out / "results.json"
    args = [f"-p {name} {value}" for name, value in SMALL.items()]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "papermill",
            str(NOTEBOOK),
            str(out / "executed.ipynb"),
            *" ".join(args).split(),
            "-p",
            "RESULTS_JSON",
            str(results),
            "--cwd",
            str(out),
        ],
        check=True,
        timeout=900,
    )
    return json.loads(results.read_text())


def test_headless_run_learns_the_task(headless_run):
    assert headless_run["train_steps"] == SMALL["TRAIN_STEPS"]
    assert headless_run["initial_loss"] > 0.8 * math.log(100)
    assert headless_run["final_loss"] < 0.2 * math.log(100)
    assert headless_run["stride_token_accuracy"] >= 0.9


def test_headless_run_reports_the_cpu_plan(headless_run):
    assert headless_run["plan"]["backend"] == "torch"
    assert headless_run["plan"]["precision"] == "fp32"
    assert headless_run["device"].startswith("CPU")
    assert headless_run["train_seconds"] > 0


def test_headless_run_inspects_reference_fp8_state_on_cpu(headless_run):
    state = headless_run["fp8_state"]
    assert state["source"] == "reference"
    per_layer = 3 + 3 + 6  # fused QKV, output projection, fc1 + fc2: input, weight, grad_output
    assert len(state["tensors"]) == 2 * per_layer + 3  # N_LAYERS=2, plus the LM head
    for row in state["tensors"]:
        assert row["format"] == ("E5M2" if row["tensor"] == "grad_output" else "E4M3")
        assert 0 < row["amax_newest"] <= row["amax_window_max"]
        assert row["scale"] * row["scale_inv"] == pytest.approx(1.0)
        assert row["scale"] != 1.0  # every scale has been updated from its history


def test_headless_reference_fp8_run_learns_like_fp32(headless_run):
    comparison = headless_run["fp8_comparison"]
    assert (comparison["fp8_source"], comparison["high_precision"]) == ("reference", "fp32")
    assert comparison["fp8_stride_token_accuracy"] >= 0.9
    assert abs(comparison["final_loss_gap"]) <= 0.10
    assert comparison["output_db"] > 20 and comparison["weight_grad_db"] > 20


def test_headless_run_records_every_section_10_experiment(headless_run):
    experiments = headless_run["experiments"]
    assert list(experiments) == [
        "e4m3_vs_hybrid",
        "amax_history",
        "building_blocks",
        "fp8_weights",
        "other_recipes",
        "benchmark",
        "scale_up",
    ]
    ran = {name for name, e in experiments.items() if e["status"] == "ran"}
    assert ran == {"e4m3_vs_hybrid", "amax_history", "benchmark", "scale_up"}
    for name in ("building_blocks", "fp8_weights", "other_recipes"):
        assert experiments[name]["status"] == "skipped"
        assert "Transformer Engine" in experiments[name]["reason"]


def test_headless_e4m3_gradients_flush_more_than_hybrids(headless_run):
    formats = headless_run["experiments"]["e4m3_vs_hybrid"]
    assert formats["E4M3"]["grad_flushed_pct"] > formats["HYBRID"]["grad_flushed_pct"]


def test_headless_benchmark_rows_on_cpu(headless_run):
    rows = headless_run["benchmark"]
    tutorial = {r["precision"]: r for r in rows if r["d_model"] == SMALL["D_MODEL"]}
    assert set(tutorial) == {"FP32 (PyTorch)", "FP8 reference (PyTorch)"}
    for r in rows:
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["tflops"] > 0
        assert r["peak_mem_mb"] is None and r["peak_share"] is None  # no GPU, no datasheet
        expected_tokens_per_s = 32 * 32 / (r["step_ms"] / 1000)  # BATCH_SIZE x SEQ_LEN
        assert r["tokens_per_s"] == pytest.approx(expected_tokens_per_s)
    skipped = headless_run["experiments"]["benchmark"]["skipped"]
    assert any(s["d_model"] == 2048 and "budget" in s["reason"] for s in skipped)
