"""The precision plan: a pure function of the hardware facts, for every runtime users have."""

import dataclasses
import re

import pytest
from notebook_source import REPO

TE_SAYS_TOO_OLD = "Device compute capability 8.9 or higher required for FP8 execution."


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
def test_auto_plan_for_each_runtime(nb, runtime, precision, backend):
    plan = nb.choose_plan(nb.EXAMPLE_RUNTIMES[runtime])
    assert (plan.precision, plan.backend) == (precision, backend)


def test_the_readme_table_is_the_computed_one(nb):
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| (.+?) \| (.+?) \| (\w+) \| (TE|PyTorch) \|", readme, re.MULTILINE)
    computed = [
        (runtime, cc, precision, modules)
        for runtime, cc, precision, modules, _ in nb.runtime_table()
    ]
    assert rows == computed


def test_the_readme_recipe_table_is_the_computed_one(nb):
    readme = (REPO / "README.md").read_text()
    header = "| TE's other recipe | " + " | ".join(nb.RECIPES_BY_CUDA) + " |"
    table = readme[readme.index(header) :].split("\n\n")[0].splitlines()[2:]
    assert [tuple(c.strip() for c in row.strip("|").split("|")) for row in table] == list(
        nb.recipe_table()
    )


def test_a100_steps_down_in_tes_own_words(nb):
    assert nb.EXAMPLE_RUNTIMES["A100"].fp8_error == TE_SAYS_TOO_OLD
    plan = nb.choose_plan(nb.EXAMPLE_RUNTIMES["A100"])
    assert plan.fallbacks == {"FP8": f"Transformer Engine says: {TE_SAYS_TOO_OLD}"}


def test_cpu_plan_explains_every_step_down(nb):
    plan = nb.choose_plan(nb.EXAMPLE_RUNTIMES["CPU"])
    assert list(plan.fallbacks) == ["FP8", "BF16", "FP16"]
    assert plan.fallbacks["BF16"] == "on a CPU, BF16 is often slower than FP32"
    assert plan.reason == "FP32 throughout, on PyTorch modules" and plan.recipe is None


def test_t4_steps_down_for_missing_te_and_missing_bf16(nb):
    plan = nb.choose_plan(nb.EXAMPLE_RUNTIMES["T4"])
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


def test_forcing_a_precision_the_runtime_lacks_says_what_it_has(nb):
    with pytest.raises(ValueError, match=r"PRECISION='fp8'.*This runtime can run: bf16, fp32"):
        nb.choose_plan(nb.EXAMPLE_RUNTIMES["CPU"], "fp8")
    with pytest.raises(ValueError, match=r"PRECISION='bf16'.*7\.5 has no BF16.*fp16, fp32"):
        nb.choose_plan(nb.EXAMPLE_RUNTIMES["T4"], "bf16")
    with pytest.raises(ValueError, match=r"PRECISION='fp8'.*8\.9 or higher"):
        nb.choose_plan(nb.EXAMPLE_RUNTIMES["A100"], "fp8")


def test_a_forced_possible_precision_has_no_step_downs(nb):
    plan = nb.choose_plan(nb.EXAMPLE_RUNTIMES["H100 / H200"], "fp32")
    assert (plan.precision, plan.backend, plan.fallbacks) == ("fp32", "te", {})
    assert plan.reason == "FP32 throughout, as requested, on Transformer Engine modules"


def test_the_cpu_is_described_by_its_machine_and_cores(nb):
    hw = nb.detect_hardware()  # no CUDA here: the CPU branch
    assert hw.name.startswith("CPU (") and "cores" in hw.name and hw.capability is None


def test_an_fp8_gpu_trains_with_this_notebooks_recipe_and_says_so(nb):
    plan = nb.choose_plan(nb.EXAMPLE_RUNTIMES["H100 / H200"])
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
