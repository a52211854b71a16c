"""Section 10: the benchmark harness, the FLOP formula, the skip rules and the experiments."""

import dataclasses
import math
import time

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

CPU = torch.device("cpu")


def test_flop_formula_matches_pytorchs_flop_counter_on_a_real_step(nb, cfg):
    cfg = dataclasses.replace(cfg, batch_size=4)
    torch.manual_seed(0)
    model = nb.build_model(cfg, "torch", CPU)
    tokens = nb.training_batch(cfg, nb.seeded_generator(0, CPU))
    # the math backend runs attention as matmuls, which the counter sees
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        nb.lm_loss(model, tokens, nb.contextlib.nullcontext).backward()
    assert counter.get_total_flops() == nb.train_flops_per_step(cfg)


def test_flop_formula_by_hand(nb, cfg):
    cfg = dataclasses.replace(
        cfg,
        d_model=16,
        ffn_hidden=32,
        n_heads=2,
        n_layers=1,
        vocab_size=16,
        seq_len=8,
        batch_size=2,
        prompt_len=2,
        gen_tokens=2,
    )
    gemm_parameters = 4 * 16 * 16 + 2 * 16 * 32 + 16 * 16  # QKV + proj, fc1 + fc2, head
    attention = 12 * 1 * 8 * 16  # per token: QK^T and AV, forward and backward
    assert nb.train_flops_per_step(cfg) == 16 * (6 * gemm_parameters + attention)


def test_sized_configs_keep_the_task_and_use_64_channel_heads(nb, cfg):
    assert nb.sized_config(cfg, cfg.d_model, cfg.n_layers) is cfg
    big = nb.sized_config(cfg, 2048, 12)
    assert (big.d_model, big.n_layers, big.n_heads, big.ffn_hidden) == (2048, 12, 32, 8192)
    assert (big.vocab_size, big.seq_len, big.batch_size) == (
        cfg.vocab_size,
        cfg.seq_len,
        cfg.batch_size,
    )


def test_memory_estimate_covers_weights_grads_and_adam_and_grows(nb, cfg):
    sizes = [
        nb.sized_config(cfg, d, n) for d, n in ((cfg.d_model, cfg.n_layers), *nb.BENCHMARK_SIZES)
    ]
    estimates = [nb.estimate_training_bytes(c) for c in sizes]
    assert all(
        e >= 16 * nb.expected_parameter_count(c) for e, c in zip(estimates, sizes, strict=True)
    )
    assert estimates == sorted(estimates)


def test_size_skip_reasons(nb):
    assert "needs about 10.0 GiB, 8.0 GiB available" in nb.size_skip_reason(
        10 * 2**30, 8 * 2**30, 1, 30
    )
    assert nb.size_skip_reason(9 * 2**30, 10 * 2**30, None, 30) is not None  # 80% rule
    assert nb.size_skip_reason(1, 2**30, 45.2, 30) == "estimated 45 s, over the 30 s budget"
    assert nb.size_skip_reason(1, 2**30, 29.0, 30) is None
    assert nb.size_skip_reason(1, 2**30, None, 30) is None


def facts(nb, device="cuda", capability=None, te=True, fp8=False, others=()):
    return nb.HardwareFacts(
        device,
        "GPU" if device == "cuda" else "CPU",
        capability,
        "2.20.2" if te else None,
        "" if te else "missing",
        fp8,
        "",
        others,
    )


@pytest.mark.parametrize(
    "runtime, labels",
    [
        ("cpu", ["FP32 (PyTorch)", "FP8 reference (PyTorch)"]),
        ("t4", ["FP32 (PyTorch)", "FP16 (PyTorch)"]),
        ("a100", ["FP32 (PyTorch)", "BF16 (PyTorch)", "BF16 (TE)"]),
        (
            "h100",
            [
                "FP32 (PyTorch)",
                "BF16 (PyTorch)",
                "BF16 (TE)",
                "FP8 DelayedScaling (TE)",
                "FP8 Float8CurrentScaling (TE)",
                "FP8 Float8BlockScaling (TE)",
            ],
        ),
    ],
)
def test_benchmark_times_every_precision_the_runtime_has(nb, runtime, labels):
    others = (
        ("Float8CurrentScaling", True, ""),
        ("Float8BlockScaling", True, ""),
        ("MXFP8BlockScaling", False, "10.0"),
        ("NVFP4BlockScaling", False, "10.0"),
    )
    runtime_facts = {
        "cpu": facts(nb, device="cpu", te=False),
        "t4": facts(nb, capability=(7, 5), te=False),
        "a100": facts(nb, capability=(8, 0)),
        "h100": facts(nb, capability=(9, 0), fp8=True, others=others),
    }[runtime]
    plan = nb.choose_plan(runtime_facts)
    assert [nb.precision_label(p) for p in nb.benchmark_plans(runtime_facts, plan)] == labels


def test_time_ms_warms_up_then_times_each_repeat(nb):
    calls = []

    def work():
        calls.append(1)
        time.sleep(0.01)

    times = nb.time_ms(work, CPU, warmup=2, repeats=3)
    assert len(calls) == 5 and len(times) == 3
    assert all(9 <= t < 100 for t in times)


@pytest.mark.parametrize(
    "name, precision, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989),
        ("NVIDIA H100 80GB HBM3", "fp8", 1979),
        ("NVIDIA H200", "fp8", 1979),
        ("NVIDIA H100 PCIe", "bf16", None),
        ("Tesla T4", "fp16", 65),
        ("NVIDIA A100-SXM4-40GB", "fp8", None),
        ("CPU (x86_64, 2 cores)", "fp32", None),
    ],
)
def test_datasheet_peaks(nb, name, precision, peak):
    assert nb.datasheet_peak_tflops(name, precision) == peak


def row(label, d, layers, ms):
    return {"precision": label, "d_model": d, "n_layers": layers, "step_ms": ms}


def test_benchmark_findings_are_written_from_the_numbers(nb):
    rows = [
        row("BF16 (TE)", 128, 2, 2.0),
        row("FP8 DelayedScaling (TE)", 128, 2, 3.0),
        row("BF16 (TE)", 2048, 12, 40.0),
        row("FP8 DelayedScaling (TE)", 2048, 12, 25.0),
    ]
    small, large = nb.benchmark_findings(rows)
    assert "fastest is BF16 (TE) (2.0 ms/step)" in small
    assert "FP8 DelayedScaling (TE) is slower than BF16 (TE) (0.67x its speed)" in small
    assert "FP8 DelayedScaling (TE) is faster than BF16 (TE) (1.60x its speed)" in large


def test_scale_up_follows_the_benchmark(nb):
    label = "FP32 (PyTorch)"
    rows = [row(label, 512, 4, 600.0), row(label, 1024, 8, 5000.0)]
    skipped = [{"precision": label, "d_model": 2048, "n_layers": 12, "reason": "too big"}]
    assert nb.scale_up_skip_reason((512, 4), label, rows, skipped) is None  # 12 s
    assert "over the 60 s budget" in nb.scale_up_skip_reason((1024, 8), label, rows, skipped)
    assert nb.scale_up_skip_reason((2048, 12), label, rows, skipped) == "too big"
    assert nb.scale_up_skip_reason((512, 4), "BF16 (TE)", rows, skipped) == (
        "not measured by the benchmark"
    )


def test_fp8_dynamic_ranges(nb):
    assert nb.fp8_dynamic_range_bits("E4M3") == pytest.approx(math.log2(448 * 2**9))
    assert nb.fp8_dynamic_range_bits("E5M2") == pytest.approx(math.log2(57344 * 2**16))


@pytest.fixture(scope="module")
def history_traces(nb):
    magnitudes = nb.activation_range_schedule()
    return magnitudes, {
        (n, algo): nb.scale_following(n, algo, magnitudes, CPU)
        for n in (16, 1024)
        for algo in ("max", "most_recent")
    }


def test_every_recipe_saturates_on_each_step_of_a_rising_range(history_traces):
    _, traces = history_traces
    for trace in traces.values():
        assert trace["saturated_pct"][0] == 0  # scale 1 covers the first step's amax of 1
        assert all(share > 0 for share in trace["saturated_pct"][1:80])


def test_most_recent_ignores_the_history_length(history_traces):
    _, traces = history_traces
    assert traces[(16, "most_recent")] == traces[(1024, "most_recent")]


def test_max_holds_a_spike_for_the_window_and_most_recent_chases_noise(nb, history_traces):
    magnitudes, traces = history_traces
    spike = nb.SPIKE_STEP
    summary = {key: nb.scale_following_summary(trace) for key, trace in traces.items()}
    short, long, recent = summary[(16, "max")], summary[(1024, "max")], summary[(16, "most_recent")]
    # after the spike, max/16 recovers within its window; max/1024 never does in this run
    short_scale, long_scale = traces[(16, "max")]["scale"], traces[(1024, "max")]["scale"]
    assert short_scale[spike + 20] > 2 * short_scale[spike + 1]
    assert long_scale[-1] == pytest.approx(long_scale[spike + 1])
    assert long["mean_flushed_pct_after_spike"] > short["mean_flushed_pct_after_spike"]
    assert short["mean_flushed_pct_after_spike"] > recent["mean_flushed_pct_after_spike"]
    # on the noisy plateau, most_recent saturates whenever the range ticks up
    assert recent["steps_saturated_on_noisy_plateau"] > 5 * max(
        1, short["steps_saturated_on_noisy_plateau"]
    )
    assert long["steps_saturated_on_noisy_plateau"] == 0


def test_run_experiment_records_ran_skipped_and_failed(nb, capsys):
    experiments = {}
    nb.run_experiment(experiments, "a", None, lambda: {"x": 1})
    nb.run_experiment(experiments, "b", "needs a GPU", lambda: {"x": 2})
    nb.run_experiment(experiments, "c", None, lambda: 1 / 0)
    assert experiments == {
        "a": {"status": "ran", "reason": "", "x": 1},
        "b": {"status": "skipped", "reason": "needs a GPU"},
        "c": {"status": "failed", "reason": "ZeroDivisionError: division by zero"},
    }
    output = capsys.readouterr().out
    assert "Skipped: needs a GPU" in output and "FAILED: ZeroDivisionError" in output


def test_json_safe_turns_non_finite_numbers_into_null(nb):
    value = {"a": [1.0, math.nan, {"b": math.inf}], "c": "text", "d": (2, -math.inf)}
    assert nb.json_safe(value) == {"a": [1.0, None, {"b": None}], "c": "text", "d": [2, None]}
