"""The precision plan: a pure function of the hardware facts, for every runtime users have."""

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
    assert plan.fallbacks == (f"not fp8: Transformer Engine says: {TE_SAYS_TOO_OLD}",)


def test_cpu_plan_explains_every_step_down(nb):
    plan = nb.choose_plan(nb.EXAMPLE_RUNTIMES["CPU"])
    assert [f.split(":")[0] for f in plan.fallbacks] == ["not fp8", "not bf16", "not fp16"]
    assert "emulates BF16" in plan.fallbacks[1]


def test_t4_steps_down_for_missing_te_and_missing_bf16(nb):
    plan = nb.choose_plan(nb.EXAMPLE_RUNTIMES["T4"])
    assert "Transformer Engine is not usable" in plan.fallbacks[0]
    assert "7.5 has no BF16" in plan.fallbacks[1]
    assert "gradient scaler" in plan.reason


def test_an_fp8_gpu_without_te_falls_back_to_pytorch_bf16(nb):
    plan = nb.choose_plan(nb.Hardware("NVIDIA L4", (8, 9), "No module named 'transformer_engine'"))
    assert (plan.precision, plan.backend) == ("bf16", "torch")
    assert "not usable" in plan.fallbacks[0]


def test_forcing_a_precision_the_runtime_lacks_says_what_it_has(nb):
    with pytest.raises(ValueError, match=r"PRECISION='fp8'.*This runtime can run: bf16, fp32"):
        nb.choose_plan(nb.EXAMPLE_RUNTIMES["CPU"], "fp8")
    with pytest.raises(ValueError, match=r"PRECISION='bf16'.*7\.5 has no BF16.*fp16, fp32"):
        nb.choose_plan(nb.EXAMPLE_RUNTIMES["T4"], "bf16")
    with pytest.raises(ValueError, match=r"PRECISION='fp8'.*8\.9 or higher"):
        nb.choose_plan(nb.EXAMPLE_RUNTIMES["A100"], "fp8")


def test_a_forced_possible_precision_has_no_step_downs(nb):
    plan = nb.choose_plan(nb.EXAMPLE_RUNTIMES["H100 / H200"], "fp32")
    assert (plan.precision, plan.backend, plan.fallbacks) == ("fp32", "te", ())
    assert "requested" in plan.reason


def test_the_cpu_is_described_by_its_machine_and_cores(nb):
    hw = nb.detect_hardware()  # no CUDA here: the CPU branch
    assert hw.name.startswith("CPU (") and "cores" in hw.name and hw.capability is None
