"""The precision plan: a pure function of the hardware facts, for every runtime users have."""

import pytest

TE_SAYS_TOO_OLD = "Device compute capability 8.9 or higher required for FP8 execution."


def facts(nb, device="cuda", name="GPU", capability=None, te=True, fp8=False, reason=""):
    return nb.HardwareFacts(
        device,
        name,
        capability,
        te_version="2.20.2" if te else None,
        te_missing_reason="" if te else "No module named 'transformer_engine'",
        fp8_available=fp8,
        fp8_reason=reason,
    )


@pytest.fixture
def runtimes(nb):
    return {
        "CPU": facts(nb, device="cpu", name="CPU", te=False),
        "T4": facts(nb, name="Tesla T4", capability=(7, 5), te=False),
        "A100": facts(nb, name="A100", capability=(8, 0), reason=TE_SAYS_TOO_OLD),
        "L4": facts(nb, name="L4", capability=(8, 9), fp8=True),
        "H100": facts(nb, name="H100", capability=(9, 0), fp8=True),
        "G4": facts(nb, name="RTX PRO 6000", capability=(12, 0), fp8=True),
    }


@pytest.mark.parametrize(
    "runtime, backend, precision",
    [
        ("CPU", "torch", "fp32"),
        ("T4", "torch", "fp16"),
        ("A100", "te", "bf16"),
        ("L4", "te", "fp8"),
        ("H100", "te", "fp8"),
        ("G4", "te", "fp8"),
    ],
)
def test_auto_plan_for_each_runtime(nb, runtimes, runtime, backend, precision):
    plan = nb.choose_plan(runtimes[runtime])
    assert (plan.backend, plan.precision) == (backend, precision)


def test_cpu_plan_explains_every_step_down(nb, runtimes):
    plan = nb.choose_plan(runtimes["CPU"])
    assert [f.split(":")[0] for f in plan.fallbacks] == ["not fp8", "not bf16", "not fp16"]
    assert "emulate BF16" in plan.fallbacks[1]


def test_t4_steps_down_for_missing_te_and_missing_bf16(nb, runtimes):
    plan = nb.choose_plan(runtimes["T4"])
    assert "Transformer Engine is not available" in plan.fallbacks[0]
    assert "7.5 has no BF16" in plan.fallbacks[1]
    assert "gradient scaler" in plan.reason


def test_a100_passes_on_te_own_reason(nb, runtimes):
    plan = nb.choose_plan(runtimes["A100"])
    assert plan.fallbacks == (f"not fp8: Transformer Engine says: {TE_SAYS_TOO_OLD}",)


def test_fp8_gpu_without_te_falls_back_to_torch_bf16(nb):
    plan = nb.choose_plan(facts(nb, name="L4", capability=(8, 9), te=False))
    assert (plan.backend, plan.precision) == ("torch", "bf16")
    assert "not available" in plan.fallbacks[0]


def test_fp8_plan_has_no_step_downs(nb, runtimes):
    assert nb.choose_plan(runtimes["H100"]).fallbacks == ()


def test_forcing_a_precision_the_runtime_lacks_says_what_it_has(nb, runtimes):
    with pytest.raises(ValueError, match=r"PRECISION='fp8'.*This runtime can run: bf16, fp32"):
        nb.choose_plan(runtimes["CPU"], "fp8")
    with pytest.raises(ValueError, match=r"PRECISION='bf16'.*7\.5 has no BF16.*fp16, fp32"):
        nb.choose_plan(runtimes["T4"], "bf16")
    with pytest.raises(ValueError, match=r"PRECISION='fp8'.*8\.9 or higher"):
        nb.choose_plan(runtimes["A100"], "fp8")


def test_forcing_a_possible_precision_is_honoured(nb, runtimes):
    plan = nb.choose_plan(runtimes["H100"], "fp32")
    assert (plan.backend, plan.precision, plan.fallbacks) == ("te", "fp32", ())
    cpu_bf16 = nb.choose_plan(runtimes["CPU"], "bf16")
    assert cpu_bf16.precision == "bf16" and "emulate BF16" in cpu_bf16.reason
