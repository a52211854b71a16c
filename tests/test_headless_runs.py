"""Real headless runs of the whole notebook on a CPU, through papermill, as a user would run it."""

import json
import os
import re
import subprocess
import sys

import pytest
from notebook_source import NOTEBOOK, README, outputs_text
from test_notebook import (
    assert_10_2s_reading_holds,
    assert_10_11s_readings_hold,
    assert_10_12s_readings_hold,
)

SUMMARY_KEYS = (
    "plan device initial_loss final_loss train_steps train_seconds stride_token_accuracy "
    "stride_sequence_accuracy fp8_state fp8_comparison benchmark experiments"
).split()


def run_notebook(tmp_path, threads=None, **parameters):
    """Execute the notebook top to bottom with papermill (torch's threads: OMP_NUM_THREADS, if
    given); returns (summary, executed notebook)."""
    results, executed = tmp_path / "results.json", tmp_path / "executed.ipynb"
    overrides = [arg for k, v in parameters.items() for arg in ("-p", k, str(v))]
    command = [sys.executable, "-m", "papermill", str(NOTEBOOK), str(executed), *overrides]
    command += ["-p", "RESULTS_JSON", str(results), "--cwd", str(tmp_path)]
    env = os.environ | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
    subprocess.run(command, check=True, timeout=900, capture_output=True, text=True, env=env)
    return json.loads(results.read_text()), json.loads(executed.read_text())


# SEQ_LEN=12, not a multiple of 8: issue 58 (FP8 decoding once padded it past the positions)
TINY = {"TRAIN_STEPS": 30, "D_MODEL": 32, "N_HEADS": 2, "FFN_HIDDEN": 64, "SEQ_LEN": 12}
TINY |= {"BATCH_SIZE": 8, "EVAL_PROMPTS": 16, "PROMPT_LEN": 4, "GEN_TOKENS": 8}


@pytest.fixture(scope="module")
def headless(tmp_path_factory):
    """The saved run's parameters (the defaults), at two threads, as the saved run had."""
    return run_notebook(tmp_path_factory.mktemp("auto"), threads=2)


@pytest.fixture(scope="module")
def one_thread(tmp_path_factory):
    return run_notebook(tmp_path_factory.mktemp("one_thread"), threads=1)


def verdicts(cells):
    """What the code cells printed, each number masked (with its sign), the thread count's line
    and RESULTS_JSON's left out: the words, verdicts among them, that no CPU or thread changes."""
    texts = ["".join(outputs_text([cell])) for cell in cells]  # a stream comes in any parts
    number = r"[+-]?\d+(\.\d+)?(e[+-]?\d+)?"
    lines = [re.sub(number, "#", line) for text in texts for line in text.splitlines()]
    skip = ("CPU threads:", "summary written to")
    return [" ".join(line.split()) for line in lines if line and not line.startswith(skip)]


def test_every_verdict_holds_at_one_and_two_threads_and_as_the_saved_run_says(headless, one_thread):
    """Issue 58: the FP8 reference's numbers move with the CPU and the thread count (one thread
    against two moved section 8's FP8 loss from 0.1347 to 0.1349, and 10.11's search named a
    layer on one machine and none on another). Every printed word, verdicts included, is the same
    at one thread and at two, and as the saved run (another machine, perhaps) printed; and the
    sentences that read the saved run hold for both runs."""
    runs = {"one thread": one_thread[1]["cells"], "two threads": headless[1]["cells"]}
    saved = json.loads(NOTEBOOK.read_text())["cells"]
    # The notebook may pick 1 thread where 2 are slower (a busy machine), so the run asked for 2
    # may use 1; the saved run used 2 (as 10.11's reading says), and the run at 1 uses 1.
    for cells, used in ((saved, "2"), (runs["one thread"], "1")):
        assert re.findall(r"CPU threads: (\d)", "".join(outputs_text(cells))) == [used]
    for name, cells in runs.items():
        assert verdicts(cells) == verdicts(saved), name
        assert_10_2s_reading_holds(cells)
        assert_10_11s_readings_hold(cells)
        assert_10_12s_readings_hold(cells)


def test_headless_run_writes_every_summary_key(headless):
    summary, _ = headless
    assert set(summary) == set(SUMMARY_KEYS)


def test_the_readme_lists_every_summary_key_and_no_other(headless):
    summary, _ = headless
    paragraph = README.read_text().split("With `RESULTS_JSON` set")[1].split("\n\n")[0]
    statuses = {"status", "ran", "skipped", "failed", "reason"}  # each experiment's
    assert set(re.findall(r"`(\w+)`", paragraph)) - statuses == set(summary)


def test_headless_run_learns_the_task(headless):
    summary, _ = headless
    assert summary["train_steps"] == 120 and summary["train_seconds"] > 0
    assert summary["initial_loss"] > 0.8 * 4.605 and summary["final_loss"] < 0.2 * 4.605
    assert summary["stride_sequence_accuracy"] >= 0.9


def test_headless_run_chooses_fp32_on_pytorch_on_a_cpu(headless):
    summary, _ = headless
    assert summary["device"].startswith("CPU")
    assert (summary["plan"]["precision"], summary["plan"]["backend"]) == ("fp32", "torch")
    # each precision above FP32 is named with why this runtime does not use it
    fallbacks = summary["plan"]["fallbacks"]
    assert list(fallbacks) == ["FP8", "BF16", "FP16"] and all(fallbacks.values())


def test_headless_run_inspects_the_reference_fp8_state_and_checks_the_rule_exactly(headless):
    state = headless[0]["fp8_state"]
    assert state["source"] == "reference"
    assert state["update_rule_max_difference"] == 0.0 and state["histories_rolled"] is True
    assert len(state["tensors"]) == 2 * (3 + 3 + 6)  # QKV, proj, fc1 + fc2 per layer; no head
    for row in state["tensors"]:
        assert 0 < row["amax"] <= row["window_max"] and row["scale"] != 1.0


def test_headless_reference_fp8_run_learns_like_fp32(headless):
    comparison = headless[0]["fp8_comparison"]
    assert comparison["status"] == "ran" and comparison["fp8"] == "FP8 (reference)"
    assert comparison["fp8_stride_sequence_accuracy"] >= 0.9
    assert abs(comparison["final_loss_gap"]) <= 0.10


def test_headless_head_out_of_fp8_gets_its_weight_gradient_closer_to_fp32_on_every_seed(headless):
    """Issue 47: the measurement behind section 6's choice, on this small model too: three seeds,
    the logits above torchao's bar, and the head's weight gradient nearer FP32 out of FP8."""
    found = headless[0]["experiments"]["head_out_of_fp8"]
    everywhere, but_head = found["FP8 everywhere"], found["FP8 but the head"]
    assert len(everywhere["loss"]) == len(but_head["loss"]) == 3
    assert min(everywhere["output_db"] + but_head["output_db"]) > 18
    assert max(everywhere["weight_grad_db"]) < min(but_head["weight_grad_db"])


def test_headless_10_11_logs_tes_statistics_from_the_reference_and_takes_each_layer_out(headless):
    health, layers = (headless[0]["experiments"][k] for k in ("fp8_health", "layer_by_layer"))
    means = health["means"]  # per tensor and statistic, at step 1 and later
    assert health["source"] == "reference" and len(means) == 3 * 8 * 2
    assert means["gradient underflows% step 1"] > means["gradient underflows% later"] > 0
    settings = ["FP8 everywhere", "layers.0 out", "layers.1 out", "no layer in FP8"]
    assert list(layers)[2:] == settings and layers["FP8 everywhere"] == [0.0] * 8  # its own base


def test_headless_run_records_every_experiment(headless):
    experiments = headless[0]["experiments"]
    ran = {
        "fp8_vs_high_precision",
        "head_out_of_fp8",
        "e4m3_vs_hybrid",
        "amax_history",
        "two_ranks",
        "checkpoint_resume",
    }
    ran |= {"recipes_on_real_tensors", "fp8_estimate", "fp8_health", "layer_by_layer"}
    ran |= {"generation_and_fp8_state", "generation_both_ways", "serving_checkpoint"}
    ran |= {"generation_estimate"}
    needs_gpu = {"te_vs_standin", "fp8_weights"}
    needs_gpu |= {"te_quantizers_vs_references", "benchmark", "data_parallel_script"}
    needs_gpu |= {"served_in_fp8_weights", "generation_timed"}
    assert set(experiments) == ran | needs_gpu
    assert {name for name, e in experiments.items() if e["status"] == "ran"} == ran
    assert all(experiments[name]["status"] == "skipped" for name in needs_gpu)
    assert all(experiments[name]["reason"] for name in needs_gpu)
    # on a CPU the script runs on two CPU ranks (the check), not on GPUs, and it says so
    assert "two CPU ranks" in experiments["data_parallel_script"]["reason"]


def test_headless_two_ranks_agree_bitwise_with_tes_reduction_and_not_without(headless):
    two = headless[0]["experiments"]["two_ranks"]
    assert two["identical_with_reduction"] and two["scales_differ_without"]
    assert two["weights_agree_without"]


def test_headless_recipe_table_covers_every_recipe_and_role(headless):
    table = headless[0]["experiments"]["recipes_on_real_tensors"]
    recipes = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling")
    for recipe in (*recipes, "NVFP4BlockScaling"):
        for role in ("input", "weight", "grad_output"):
            assert table[f"{recipe}/{role}"]["sqnr_db"] > 5
    assert all(table[f"{r}/weight"]["sqnr_db"] > 20 for r in recipes)  # 8-bit, every weight


def test_headless_e4m3_gradients_flush_more_than_hybrids(headless):
    formats = headless[0]["experiments"]["e4m3_vs_hybrid"]
    assert formats["E4M3"]["grad_underflows%"] > formats["HYBRID"]["grad_underflows%"]


def test_headless_run_times_nothing_on_a_cpu_and_says_why(headless):
    summary, _ = headless
    assert summary["benchmark"] == []
    assert "GPU" in summary["experiments"]["benchmark"]["reason"]


def test_headless_fp8_estimate_grows_with_size_and_tokens_from_a_loss_to_a_gain(headless):
    """The estimate's point, per GPU: FP8 loses at this tutorial's size and wins at 2048 x 12,
    more with more tokens a step (issue 45: the weights' casts and AdamW are paid once a step);
    RESULTS_JSON keeps each part's time, so that a GPU run can set its timings beside them."""
    by_size = headless[0]["experiments"]["fp8_estimate"]["by_size"]
    assert {row["gpu"] for row in by_size} == {"L4", "H100", "RTX PRO 6000"}
    parts = "bf16_gemms_ms fp8_gemms_ms fp8_casts_ms weight_casts_ms optimizer_ms".split()
    for gpu in ("L4", "H100", "RTX PRO 6000"):
        rows = [row for row in by_size if row["gpu"] == gpu]
        assert [(r["d_model"], r["tokens"]) for r in rows][1:] == [
            (2048, 1024),
            (2048, 4096),
            (2048, 16384),
        ]
        for speedup in ("linear_speedup", "step_speedup"):
            gains = [row[speedup] for row in rows]
            assert gains == sorted(gains) and gains[0] < 1 < gains[-1]
        assert all(row[part] > 0 for row in rows for part in parts)
    # issue 62: the launches, at this host's measured cost, bound the tutorial's step on an H100
    # (its GPU's work about 0.015 ms) and not the 16,384 tokens at 2048 x 12 (46 ms in FP8, 68 in
    # BF16)
    assert headless[0]["experiments"]["fp8_estimate"]["us_a_launch"] > 0
    h100 = [row for row in by_size if row["gpu"] == "H100"]
    assert (h100[0]["bound"], h100[-1]["bound"]) == ("launches", "GPU")


def test_headless_resume_is_bitwise_and_without_its_fp8_state_flushes_once(headless):
    """Issue 46, 10.7 on a CPU: the resume from a checkpoint is bitwise the straight run; from
    the same checkpoint without its FP8 state, the first step flushes far more than the next."""
    resume = headless[0]["experiments"]["checkpoint_resume"]
    assert resume["status"] == "ran" and resume["bitwise_same"] is True
    assert resume["fp8_states_after_eval"] == 0  # issue 58: saved after an evaluation, as TE
    (_, _, first_flushed), (_, _, next_flushed) = resume["without_fp8_state"][:2]
    assert first_flushed > 10 * next_flushed


def test_headless_outputs_are_formatted_for_people(headless):
    """No raw dict, list of dicts or dataclass repr is printed."""
    _, executed = headless
    for cell in executed["cells"]:
        for output in cell.get("outputs", []):
            text = "".join(output.get("text", ""))
            assert not re.search(r"\{'|\[\{|Config\(|Plan\(|Hardware\(", text), text


@pytest.mark.parametrize(
    "precision, short",
    [("fp32", {"TRAIN_STEPS": 1}), ("bf16", {"TRAIN_STEPS": 2, "BATCH_SIZE": 3})],
)
def test_every_precision_a_cpu_supports_runs_to_the_end_when_forced(tmp_path, precision, short):
    summary, executed = run_notebook(tmp_path, PRECISION=precision, **TINY | short)
    assert summary["plan"]["precision"] == precision and summary["plan"]["fallbacks"] == {}
    assert "requested" in summary["plan"]["reason"]
    assert summary["experiments"]["fp8_weights"]["status"] == "skipped"
    if short["TRAIN_STEPS"] == 1:
        one_step_reads_well(executed)
    else:  # an odd batch: the two-rank check is skipped, saying why, not failed
        reason = "BATCH_SIZE=3 is odd: two ranks need equal shares"
        assert summary["experiments"]["two_ranks"] == {"status": "skipped", "reason": reason}
        assert "Too few steps to draw (TRAIN_STEPS=2)" in "".join(outputs_text(executed["cells"]))


def one_step_reads_well(executed):
    """Issue 44: TRAIN_STEPS=1 printed "the mean of the last 1 steps" and "0 of 0", and drew
    empty plots; it says so in words now, and the failed stride check says what to change."""
    text = "".join(outputs_text(executed["cells"]))
    for words in (
        "at step 1, the only step: train longer",
        "Too few steps to draw (TRAIN_STEPS=1)",
    ):
        assert words in text
    assert "It did NOT learn it (TRAIN_STEPS=1): try more steps." in text
    assert "HYBRID: step    1/1" in text  # 10.3 follows TRAIN_STEPS below 30
    assert not re.search(r"last 1 (of 1 )?steps| 0 of 0|\b1 steps", text)
    for cell in executed["cells"]:  # no figure from the one step's losses or scales
        drawn = any("image/png" in o.get("data", {}) for o in cell.get("outputs", []))
        source = "".join(cell["source"])
        assert not drawn or not re.search(r"training loss|plot_scales\(", source)


def test_forcing_a_precision_the_cpu_lacks_stops_at_the_plan_with_what_it_can_run(tmp_path):
    with pytest.raises(subprocess.CalledProcessError) as failure:
        run_notebook(tmp_path, PRECISION="fp16", **TINY)
    assert "PRECISION='fp16' is not possible" in failure.value.stdout + failure.value.stderr
    assert "This runtime can run: bf16, fp32" in failure.value.stdout + failure.value.stderr


def test_the_summarys_fp8_state_is_the_one_section_8_2_printed_and_checked(headless):
    """Later FP8 autocasts (section 10's) update the model's state again, so the summary keeps
    the snapshot taken where the state was printed and checked, not the state at the end."""
    summary, executed = headless
    printed = next(
        "".join(o.get("text", ""))
        for c in executed["cells"]
        if c["cell_type"] == "code" and "fp8_rows = print_fp8_state(" in "".join(c["source"])
        for o in c["outputs"]
    )
    lines = {line.split()[0]: line.split()[1:] for line in printed.splitlines() if "/" in line}
    for row in summary["fp8_state"]["tensors"]:
        amax, window_max, scale, _ = lines[row["tensor"]]
        assert (amax, window_max) == (f"{row['amax']:.3g}", f"{row['window_max']:.3g}")
        assert scale == f"{row['scale']:.3e}"
