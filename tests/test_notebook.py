"""The notebook as a whole: its shape (issue 7's targets), and real headless runs on CPU."""

import ast
import json
import re
import statistics
import subprocess
import symtable
import sys

import pytest
from notebook_source import NOTEBOOK, REPO, notebook_cells

PARAMETERS = (
    "PRECISION SEED VOCAB_SIZE MAX_STRIDE SEQ_LEN D_MODEL N_LAYERS N_HEADS FFN_HIDDEN BATCH_SIZE "
    "TRAIN_STEPS LEARNING_RATE FP8_FORMAT AMAX_HISTORY_LEN AMAX_COMPUTE_ALGO FP8_MARGIN "
    "EVAL_PROMPTS PROMPT_LEN GEN_TOKENS RESULTS_JSON"
).split()
SUMMARY_KEYS = (
    "plan device initial_loss final_loss train_steps train_seconds stride_token_accuracy "
    "stride_sequence_accuracy fp8_state fp8_comparison benchmark experiments"
).split()


def code_lines(cell):
    return [line for line in "".join(cell["source"]).splitlines() if line.strip()]


def code_cells():
    return [c for c in notebook_cells() if c["cell_type"] == "code"]


def core_cells():
    """The code cells up to and including the stride check of the FP8 run (end of section 9)."""
    cells = code_cells()
    last = next(
        i for i, c in enumerate(cells) if "fp8_scores = stride_scores" in "".join(c["source"])
    )
    return cells[: last + 1]


def test_one_parameters_cell_defines_exactly_the_documented_names():
    cells = notebook_cells("parameters")
    assert len(cells) == 1
    tree = ast.parse("".join(cells[0]["source"]))
    assigned = [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets]
    assert assigned == PARAMETERS


def global_reads(source):
    """Names a cell's code reads from outside itself: module-level reads, and functions' globals."""
    reads, tables = set(), [symtable.symtable(source, "cell", "exec")]
    while tables:
        table = tables.pop()
        tables += table.get_children()
        for symbol in table.get_symbols():
            outside = (
                symbol.is_global() if table.get_type() != "module" else not symbol.is_assigned()
            )
            reads |= {symbol.get_name()} if symbol.is_referenced() and outside else set()
    return reads


def test_definition_cells_read_nothing_the_narrative_cells_define():
    """Definitions take their inputs as arguments (a Config, a plan), so that tests and users can
    call them with any values; only the notebook's narrative cells read the parameters."""
    narrative = set(PARAMETERS)
    for cell in code_cells():
        if "defs" not in cell["metadata"].get("tags", []):
            tree = ast.parse("".join(cell["source"]))
            narrative |= {
                n.id
                for n in ast.walk(tree)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            }
    for cell in notebook_cells("defs"):
        assert not global_reads("".join(cell["source"])) & narrative, "".join(cell["source"])[:200]


def test_no_cell_is_empty():
    assert all("".join(cell["source"]).strip() for cell in notebook_cells())


def test_saved_notebook_has_no_outputs():
    """Outputs would have to come from a run of exactly this code; we keep none."""
    for cell in code_cells():
        assert cell["outputs"] == [] and cell["execution_count"] is None


def test_size_targets_a_reader_can_hold():
    sizes = [len(code_lines(c)) for c in code_cells()]
    assert sum(sizes) <= 1100
    assert sum(len(code_lines(c)) for c in core_cells()) <= 600
    assert max(sizes) <= 60
    assert statistics.median(sizes) <= 15


def test_the_first_te_transformer_layer_comes_within_300_code_lines():
    seen = 0
    for cell in code_cells():
        for line in code_lines(cell):
            seen += 1
            if "te.TransformerLayer(" in line:
                assert seen <= 300
                return
    raise AssertionError("no te.TransformerLayer( in the notebook")


def test_one_short_cell_holds_a_literal_copyable_training_step():
    steps = [c for c in code_cells() if "def train_step(" in "".join(c["source"])]
    assert len(steps) == 1
    source, lines = "".join(steps[0]["source"]), code_lines(steps[0])
    assert len(lines) <= 30
    order = ["with torch.autocast(", "with te.autocast(enabled=", "recipe=recipe)", "model(inputs)"]
    order += ["loss.backward()", "clip_grad_norm_(", "optimizer.step()"]
    positions = [source.index(fragment) for fragment in order]
    assert positions == sorted(positions)


def test_the_te_model_reads_on_its_own_in_one_short_cell():
    (cell,) = [c for c in code_cells() if "class CausalLM(" in "".join(c["source"])]
    source = "".join(cell["source"])
    assert len(code_lines(cell)) <= 40
    for piece in ("nn.Embedding(", "te.TransformerLayer(", "te.LayerNorm(", "te.Linear("):
        assert piece in source
    assert 'attn_input_format="bshd"' in source and 'self_attn_mask_type="causal"' in source


def test_at_most_six_figures_before_going_further():
    shows = sum("".join(c["source"]).count("plt.show()") for c in core_cells())
    assert 1 <= shows <= 6


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)```", readme, re.DOTALL)
    assert len(commands) == 2  # one runs the notebook, one runs the tests
    test_command = next(c.strip() for c in commands if "pytest" in c)
    assert test_command in (REPO / ".ci" / "run").read_text()


def run_notebook(tmp_path, **parameters):
    """Execute the notebook top to bottom with papermill; returns (summary, executed notebook)."""
    results, executed = tmp_path / "results.json", tmp_path / "executed.ipynb"
    overrides = [arg for k, v in parameters.items() for arg in ("-p", k, str(v))]
    command = [sys.executable, "-m", "papermill", str(NOTEBOOK), str(executed), *overrides]
    command += ["-p", "RESULTS_JSON", str(results), "--cwd", str(tmp_path)]
    subprocess.run(command, check=True, timeout=900, capture_output=True, text=True)
    return json.loads(results.read_text()), json.loads(executed.read_text())


# Small enough for CI, large enough to learn the task.
SMALL = {"TRAIN_STEPS": 200, "D_MODEL": 64, "FFN_HIDDEN": 256, "EVAL_PROMPTS": 64}
TINY = {"TRAIN_STEPS": 30, "D_MODEL": 32, "N_HEADS": 2, "FFN_HIDDEN": 64, "SEQ_LEN": 16}
TINY |= {"BATCH_SIZE": 8, "EVAL_PROMPTS": 16, "PROMPT_LEN": 4, "GEN_TOKENS": 8}


@pytest.fixture(scope="module")
def headless(tmp_path_factory):
    return run_notebook(tmp_path_factory.mktemp("auto"), **SMALL)


def test_headless_run_writes_every_summary_key(headless):
    summary, _ = headless
    assert set(summary) == set(SUMMARY_KEYS)


def test_headless_run_learns_the_task(headless):
    summary, _ = headless
    assert summary["train_steps"] == SMALL["TRAIN_STEPS"] and summary["train_seconds"] > 0
    assert summary["initial_loss"] > 0.8 * 4.605 and summary["final_loss"] < 0.2 * 4.605
    assert summary["stride_sequence_accuracy"] >= 0.9


def test_headless_run_chooses_fp32_on_pytorch_on_a_cpu(headless):
    summary, _ = headless
    assert summary["device"].startswith("CPU")
    assert (summary["plan"]["precision"], summary["plan"]["backend"]) == ("fp32", "torch")
    assert [f.split(":")[0] for f in summary["plan"]["fallbacks"]] == [
        "not fp8",
        "not bf16",
        "not fp16",
    ]


def test_headless_run_inspects_the_reference_fp8_state_and_checks_the_rule_exactly(headless):
    state = headless[0]["fp8_state"]
    assert state["source"] == "reference"
    assert state["update_rule_max_difference"] == 0.0 and state["histories_rolled"] is True
    assert len(state["tensors"]) == 2 * (3 + 3 + 6) + 3  # QKV, proj, fc1 + fc2 per layer; head
    for row in state["tensors"]:
        assert 0 < row["amax"] <= row["window_max"] and row["scale"] != 1.0


def test_headless_reference_fp8_run_learns_like_fp32(headless):
    comparison = headless[0]["fp8_comparison"]
    assert comparison["status"] == "ran" and comparison["fp8_source"] == "reference"
    assert comparison["fp8_stride_sequence_accuracy"] >= 0.9
    assert abs(comparison["final_loss_gap"]) <= 0.10
    assert comparison["output_db"] > 20 and comparison["weight_grad_db"] > 20


def test_headless_run_records_every_experiment(headless):
    experiments = headless[0]["experiments"]
    ran = {"fp8_vs_high_precision", "e4m3_vs_hybrid", "amax_history", "benchmark"}
    needs_te = {
        "te_vs_standin",
        "te_vs_reference",
        "building_blocks",
        "fp8_weights",
        "other_recipes",
    }
    assert set(experiments) == ran | needs_te
    assert {name for name, e in experiments.items() if e["status"] == "ran"} == ran
    assert all(experiments[name]["reason"] for name in needs_te)


def test_headless_e4m3_gradients_flush_more_than_hybrids(headless):
    formats = headless[0]["experiments"]["e4m3_vs_hybrid"]
    assert formats["E4M3"]["grad_flushed_pct"] > formats["HYBRID"]["grad_flushed_pct"]


def test_headless_benchmark_measures_two_sizes_on_a_cpu_and_says_why(headless):
    summary, executed = headless
    rows = summary["benchmark"]
    assert {(r["precision"], r["d_model"]) for r in rows} == {
        (p, d) for p in ("FP32 (PyTorch)", "FP8 (reference)") for d in (SMALL["D_MODEL"], 512)
    }
    for r in rows:
        assert r["status"] == "ran" and r["step_ms"] > 0 and r["peak_share"] is None
        assert r["tokens_per_s"] == pytest.approx(32 * 32 / (r["step_ms"] / 1000))
    assert len(summary["experiments"]["benchmark"]["findings"]) == 2
    markdown = "".join(
        "".join(c["source"]) for c in executed["cells"] if c["cell_type"] == "markdown"
    )
    assert "On a CPU only the tutorial's size and one larger size are measured" in markdown


def test_headless_outputs_are_formatted_for_people(headless):
    """No raw dict, list of dicts or dataclass repr is printed."""
    _, executed = headless
    for cell in executed["cells"]:
        for output in cell.get("outputs", []):
            text = "".join(output.get("text", ""))
            assert not re.search(r"\{'|\[\{|Config\(|Plan\(|Hardware\(", text), text


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_precision_a_cpu_supports_runs_to_the_end_when_forced(tmp_path, precision):
    summary, _ = run_notebook(tmp_path, PRECISION=precision, **TINY)
    assert summary["plan"]["precision"] == precision and summary["plan"]["fallbacks"] == []
    assert "requested" in summary["plan"]["reason"]
    assert summary["experiments"]["te_vs_reference"]["status"] == "skipped"


def test_forcing_a_precision_the_cpu_lacks_stops_at_the_plan_with_what_it_can_run(tmp_path):
    with pytest.raises(subprocess.CalledProcessError) as failure:
        run_notebook(tmp_path, PRECISION="fp16", **TINY)
    assert "PRECISION='fp16' is not possible" in failure.value.stdout + failure.value.stderr
    assert "This runtime can run: bf16, fp32" in failure.value.stdout + failure.value.stderr
