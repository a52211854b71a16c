"""The precision plan: a pure function of the hardware facts, for every runtime users have."""

import contextlib
import dataclasses
import pickle
import re
import types

import pytest
import torch
from example_runtimes import (
    RECIPES_HEADER,
    RUNTIMES_HEADER,
    TE_SAYS_BELOW_89,
    example_runtimes,
    plan_rows,
    tes_check,
)
from notebook_source import README, markdown_cell, markdown_table


@pytest.fixture(scope="module")
def runtimes(nb):
    return example_runtimes(nb)


@pytest.mark.parametrize(
    "runtime, precision, backend",
    [
        ("CPU", "fp32", "torch"),
        ("T4", "fp16", "torch"),
        ("A100", "bf16", "te"),
        ("L4", "fp8", "te"),
        ("H100 / H200", "fp8", "te"),
        ("G4 (RTX PRO 6000)", "fp8", "te"),
    ],
)
def test_auto_plan_for_each_runtime(nb, runtimes, runtime, precision, backend):
    plan = nb.choose_plan(runtimes[runtime])
    assert (plan.precision, plan.backend) == (precision, backend)


def test_the_runtime_tables_of_10_1_and_the_readme_are_choose_plan_on_each_runtime(nb):
    notebook = markdown_table(RUNTIMES_HEADER, markdown_cell("### 10.1 "))
    assert notebook == markdown_table(RUNTIMES_HEADER, README.read_text())
    computed = list(plan_rows(nb))
    assert [row[:5] for row in notebook] == [row[:5] for row in computed]
    for row, (*_, why_not) in zip(notebook, computed, strict=True):  # its words, and a note
        assert row[5] == why_not or row[5].startswith(why_not + " ("), row
    assert TE_SAYS_BELOW_89 in {row[0]: row[5] for row in notebook}["A100"]


def test_the_recipe_tables_of_10_1_and_the_readme_agree_and_name_every_recipe(nb):
    notebook = markdown_table(RECIPES_HEADER, markdown_cell("### 10.1 "))
    assert notebook == markdown_table(RECIPES_HEADER, README.read_text())
    assert [row[0] for row in notebook] == list(nb.RECIPE_CHECKS)
    checks = {tes_check(cell) for row in notebook for cell in row[1:]}
    assert checks <= {"yes", "no", "with CUDA 13.0 only"}
    on_g4 = {row[0]: row[-1] for row in notebook}  # what only a run on a G4 can decide
    for name in ("Float8BlockScaling", "NVFP4BlockScaling"):
        assert on_g4[name].endswith(": undecided until it runs on a G4"), on_g4[name]


def test_a100_steps_down_in_tes_own_words(nb, runtimes):
    assert runtimes["A100"].fp8_error == TE_SAYS_BELOW_89
    plan = nb.choose_plan(runtimes["A100"])
    assert plan.fallbacks == {"FP8": f"Transformer Engine says: {TE_SAYS_BELOW_89}"}


def test_cpu_plan_explains_every_step_down(nb, runtimes):
    plan = nb.choose_plan(runtimes["CPU"])
    assert list(plan.fallbacks) == ["FP8", "BF16", "FP16"]
    assert plan.fallbacks["BF16"] == nb.CPU_BF16  # issue 44: a rule, true of a CPU with BF16
    assert "rule" in nb.CPU_BF16 and not re.search(r"none|lack|without|only with", nb.CPU_BF16)
    assert plan.reason == "FP32 throughout, on PyTorch modules" and plan.recipe is None


def test_t4_steps_down_for_missing_te_and_missing_bf16(nb, runtimes):
    plan = nb.choose_plan(runtimes["T4"])
    assert "Transformer Engine is not usable" in plan.fallbacks["FP8"]
    assert "7.5 has no BF16" in plan.fallbacks["BF16"]
    assert (
        plan.reason
        == "FP16 autocast with a gradient scaler, FP32 master weights, on PyTorch modules"
    )


def test_an_fp8_gpu_without_te_falls_back_to_pytorch_bf16(nb):
    plan = nb.choose_plan(nb.Hardware("NVIDIA L4", (8, 9), "No module named 'transformer_engine'"))
    assert (plan.precision, plan.backend) == ("bf16", "torch")
    assert "not usable" in plan.fallbacks["FP8"]


def test_forcing_a_precision_the_runtime_lacks_says_what_it_has(nb, runtimes):
    with pytest.raises(ValueError, match=r"PRECISION='fp8'.*This runtime can run: bf16, fp32"):
        nb.choose_plan(runtimes["CPU"], "fp8")
    with pytest.raises(ValueError, match=r"PRECISION='bf16'.*7\.5 has no BF16.*fp16, fp32"):
        nb.choose_plan(runtimes["T4"], "bf16")
    with pytest.raises(ValueError, match=r"PRECISION='fp8'.*8\.9 or higher"):
        nb.choose_plan(runtimes["A100"], "fp8")


def test_a_forced_possible_precision_has_no_step_downs(nb, runtimes):
    plan = nb.choose_plan(runtimes["H100 / H200"], "fp32")
    assert (plan.precision, plan.backend, plan.fallbacks) == ("fp32", "te", {})
    assert plan.reason == "FP32 throughout, as requested, on Transformer Engine modules"


def test_the_cpu_is_described_by_its_machine_and_cores(nb):
    hw = nb.detect_hardware()  # no CUDA here: the CPU branch
    assert hw.name.startswith("CPU (") and "cores" in hw.name and hw.capability is None


def test_an_fp8_gpu_trains_with_this_notebooks_recipe_and_says_so(nb, runtimes):
    plan = nb.choose_plan(runtimes["H100 / H200"])
    assert (plan.recipe, plan.fallbacks) == ("DelayedScaling", {})
    assert plan.reason.startswith("FP8 GEMMs with DelayedScaling, BF16 elsewhere, FP32 master")


def test_where_a_delayed_scaling_step_raised_the_plan_takes_tes_default_and_says_why(nb):
    """detect_hardware (tests/te_stage runs it with the step's failure injected) records TE's
    own default recipe when one FP8 step of DelayedScaling raised and one of the default ran."""
    raised = "one FP8 step with DelayedScaling raised RuntimeError: cuBLAS failed"
    hw = nb.Hardware("RTX PRO 6000", (12, 0), None, None, "Float8CurrentScaling")
    fallback = type("Float8CurrentScaling", (), {})()  # TE's recipe: only its name is read here
    plan = nb.choose_plan(dataclasses.replace(hw, fp8_fallback=fallback, fp8_note=raised))
    assert (plan.precision, plan.recipe) == ("fp8", "Float8CurrentScaling")
    assert plan.fallbacks == {"DelayedScaling": raised}


def test_where_fp8_steps_raised_everywhere_the_plan_steps_down_to_bf16_in_tes_words(nb):
    raised = "one FP8 step with DelayedScaling raised RuntimeError: no kernel image"
    plan = nb.choose_plan(nb.Hardware("NVIDIA H100", (9, 0), None, raised, "DelayedScaling"))
    assert (plan.precision, plan.recipe) == ("bf16", None)
    assert plan.fallbacks == {"FP8": f"Transformer Engine says: {raised}"}


def probe_modules(layer):
    """`te` for one_te_step, its outcome injected: `layer` stands for TE's layer; no FP8."""
    manager = types.SimpleNamespace(reset=lambda: None)
    return types.SimpleNamespace(
        TransformerLayer=lambda *args, **kwargs: layer,
        autocast=lambda **kwargs: contextlib.nullcontext(),
        quantization=types.SimpleNamespace(FP8GlobalStateManager=manager),
    )


def test_a_probe_step_counts_only_with_finite_output_and_gradients_its_layer_injected(nb):
    """Issue 60: a kernel that returns garbage raised nothing, and got FP8 planned."""
    torch.manual_seed(0)
    with nb.using(probe_modules(torch.nn.Linear(128, 128))):
        assert nb.one_te_step(None) is None
    broken = torch.nn.Linear(128, 128)
    torch.nn.init.constant_(broken.weight, float("inf"))
    with nb.using(probe_modules(broken)):
        assert nb.one_te_step(None) == "no error raised, but its output or gradients are not finite"
    with nb.using(probe_modules(torch.nn.Linear(64, 64))):  # the wrong width: torch's words
        assert nb.one_te_step(None).startswith("RuntimeError: mat1 and mat2 shapes cannot be")


def test_a_step_in_its_own_process_that_dies_is_reported_in_its_words(nb, tmp_path, monkeypatch):
    """The probe's process, for real: on this CPU its one_te_step finds no TE and its cleanup
    raises, so the process exits with an error; the notebook gets the error's words and goes on."""
    monkeypatch.chdir(tmp_path)  # where it writes fp8_probe.py
    said = nb.one_step_alone({"a recipe": "pickled"}, limit_s=120)
    assert said.startswith("exited with status 1:") and "AttributeError" in said


@pytest.mark.parametrize("printed, outcome", [("null", None), ('"E: no kernel"', "E: no kernel")])
def test_a_step_in_its_own_process_returns_its_last_line_its_process_injected(
    nb, tmp_path, monkeypatch, printed, outcome
):
    """What the process printed last (before it, the cells' own prints) is the outcome; the recipe
    reaches it pickled, intact, in the file it runs: the probe's cells, then the step."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(nb, "run_with_limit", lambda command, limit_s: f"TE 2.20.2\n{printed}\n")
    assert nb.one_step_alone({"recipe": [1, 2]}) == outcome
    probe = (tmp_path / "fp8_probe.py").read_text()
    assert "def one_te_step(" in probe and "def import_te(" in probe
    assert probe.endswith(f"one_te_step(pickle.loads({pickle.dumps({'recipe': [1, 2]})!r}))))\n")
