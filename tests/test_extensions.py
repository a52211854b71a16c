"""Section 10: the experiment harness, the benchmark's arithmetic and skip rules, and what the
amax-history experiment shows."""

import pytest
import torch
from notebook_source import notebook_cells, source

CPU = torch.device("cpu")


def test_sized_configs_keep_the_task_with_64_channel_heads_and_smaller_steps(nb, cfg):
    big = nb.sized_config(cfg, 2048, 12)
    assert (big.d_model, big.n_layers, big.n_heads, big.ffn_hidden) == (2048, 12, 32, 8192)
    assert (big.vocab_size, big.seq_len, big.batch_size) == (
        cfg.vocab_size,
        cfg.seq_len,
        cfg.batch_size,
    )
    assert big.learning_rate == pytest.approx(cfg.learning_rate * cfg.d_model / 2048)
    assert nb.sized_config(cfg, cfg.d_model, cfg.n_layers) == cfg


def benchmark_namespace(nb, cfg, median_step_ms):
    """The benchmark's cell run on a CPU, in the FP8 plan, with median_step_ms injected."""
    (cell,) = [c for c in notebook_cells() if "def benchmark(" in source(c)]
    namespace = dict(vars(nb), cfg=cfg, device=CPU, run_recipe=None, other_recipes_here=list)
    namespace |= {"plan": nb.Plan("fp8", "te", "", {}, "DelayedScaling"), "hw": nb.Hardware("CPU")}
    exec(source(cell), namespace)  # noqa: S102 the notebook's own cell
    namespace["median_step_ms"] = median_step_ms
    return namespace


def test_a_size_out_of_gpu_memory_ends_the_benchmark_there_its_timings_injected(nb, cfg, capsys):
    """Our loop around the timings, on a CPU: median_step_ms is injected, and raises torch's
    out-of-memory error from d_model 1024 on; the sizes before it are kept."""

    def median_step_ms(size_cfg, run_recipe, device):
        if size_cfg.d_model >= 1024:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return 10.0

    namespace = benchmark_namespace(nb, cfg, median_step_ms)
    found = namespace["benchmark"](rounds=2)
    assert "d_model 1024 x 8 and larger: skipped, out of GPU memory" in capsys.readouterr().out
    timed = [(row["precision"], row["d_model"], row["ms"]) for row in found["rows"]]
    assert timed == [
        (precision, d_model, [10.0, 10.0])
        for d_model in (cfg.d_model, 512)
        for precision in ("BF16 (TE)", "FP8 DelayedScaling (TE)")
    ]


def test_a_fresh_model_is_timed_after_its_warm_up(nb, cfg):
    assert nb.median_step_ms(cfg, None, CPU, warmup=1, repeats=2) > 0


def timings(**by_label):
    return {(512, 4): by_label}


def test_a_difference_outside_the_rounds_spread_is_reported_as_a_ratio(nb):
    (line,) = nb.benchmark_findings(
        timings(**{"BF16 (TE)": [40.0, 41.0, 40.5], "FP8 DelayedScaling (TE)": [25.0, 25.5, 26.0]})
    )
    assert line == (
        "d_model 512 x 4 layers: FP8 DelayedScaling (TE) against BF16 (TE): "
        "1.59x its speed, faster."
    )


def test_a_difference_inside_the_rounds_spread_is_no_measurable_difference(nb):
    """Noisy rounds, as on a busy machine: one slow round must not decide the finding."""
    (line,) = nb.benchmark_findings(
        timings(**{"BF16 (TE)": [10.0, 10.4, 14.0], "FP8 DelayedScaling (TE)": [10.2, 9.0, 10.3]})
    )
    assert line.endswith("no measurable difference (the spread between rounds is larger).")


def test_one_slow_round_that_would_flip_a_ratio_of_means_is_no_measurable_difference(nb):
    """Means say FP8 is slower (25.4 ms against 20.2), medians that it is faster (18.1 against
    20.2): the one slow round's spread is larger than either difference, so no verdict."""
    (line,) = nb.benchmark_findings(
        timings(**{"BF16 (TE)": [20.0, 20.2, 20.4], "FP8 DelayedScaling (TE)": [18.0, 18.1, 40.0]})
    )
    assert line.endswith("no measurable difference (the spread between rounds is larger).")


def test_the_ratio_is_of_the_medians_not_of_the_means(nb):
    """One slow FP8 round inside a clear gain: medians give 2.00x, means would give 1.53x."""
    (line,) = nb.benchmark_findings(
        timings(**{"BF16 (TE)": [40.0, 40.0, 40.5], "FP8 DelayedScaling (TE)": [20.0, 20.0, 39.0]})
    )
    assert line.endswith("2.00x its speed, faster.")


def test_fp8_is_compared_with_fp8_and_nvfp4_on_its_own(nb):
    """The fastest FP8 recipe against BF16, and NVFP4 (4-bit, not FP8) in a line of its own."""
    lines = nb.benchmark_findings(
        timings(
            **{
                "BF16 (TE)": [40.0, 40.0, 40.0],
                "FP8 DelayedScaling (TE)": [30.0, 30.0, 30.0],
                "FP8 Float8CurrentScaling (TE)": [32.0, 32.0, 32.0],
                "NVFP4 NVFP4BlockScaling (TE)": [20.0, 20.0, 20.0],
            }
        )
    )
    assert [line.split(": ")[1] for line in lines] == [
        "FP8 DelayedScaling (TE) against BF16 (TE)",
        "NVFP4 NVFP4BlockScaling (TE) against BF16 (TE)",
    ]


def test_the_estimate_finds_fp8_slower_where_casts_dominate_and_faster_on_large_gemms(nb, cfg):
    """The roofline estimate of the linear layers: at this notebook's width the casts' extra
    memory traffic outweighs the faster GEMMs; at 8192 wide with 16k tokens the GEMMs dominate,
    and FP8 approaches, without reaching, its 2x peak."""
    small, large = nb.sized_config(cfg, 128, 2), nb.sized_config(cfg, 8192, 1)
    for gpu in nb.FP8_GPUS:
        small_gain = nb.linear_estimate(small, 1024, gpu)["speedup"]
        assert small_gain < 1 < nb.linear_estimate(large, 16384, gpu)["speedup"] < 2, gpu


def test_the_estimate_of_one_compute_bound_gemm_is_its_flops_at_the_peak(nb, cfg, monkeypatch):
    big = nb.sized_config(cfg, 8192, 1)
    monkeypatch.setattr(nb, "linear_gemms", lambda cfg, tokens: [(tokens, 8192, 8192)])
    bf16_tflops, fp8_tflops, tbps = nb.FP8_GPUS["H100"]
    flops = 3 * 2 * 16384 * 8192 * 8192  # fprop, dgrad and wgrad
    weight_cast_ms = 6 * 8192 * 8192 / (tbps * 1e12) * 1000  # FP32 read, BF16 written
    found = nb.linear_estimate(big, 16384, "H100")
    assert found["gflop"] == flops / 1e9
    assert found["bf16_ms"] == pytest.approx(flops / (bf16_tflops * 1e12) * 1000 + weight_cast_ms)
    M, K, N = 16384, 8192, 8192  # BF16 operands and outputs, but wgrad's FP32 weight gradient
    gemm_bytes = (2 * M * K + 2 * K * N + 2 * M * N) + (2 * M * N + 2 * K * N + 2 * M * K)
    gemm_bytes += 2 * M * K + 2 * M * N + 4 * K * N
    assert found["bf16_mb"] == pytest.approx((gemm_bytes + 6 * 8192 * 8192) / 1e6)
    # in FP8: 1-byte operands, the same outputs; the weight's cast, and the input's and the
    # gradient's (BF16 read, FP8 and its transpose written: 4 bytes an element)
    fp8_bytes = (
        (M * K + K * N + 2 * M * N) + (M * N + K * N + 2 * M * K) + (M * K + M * N + 4 * K * N)
    )
    assert found["fp8_mb"] == pytest.approx((fp8_bytes + 6 * K * N + 4 * (M * K + M * N)) / 1e6)
    assert found["fp8_ms"] > flops / (fp8_tflops * 1e12) * 1000  # the FP8 GEMMs plus their casts


def test_the_benchmark_sets_the_estimate_for_this_gpu_beside_its_timings_injected(nb, cfg, capsys):
    """Our loop around the timings, on a CPU, the GPU's name and its timings injected."""
    namespace = benchmark_namespace(nb, cfg, lambda size_cfg, run_recipe, device: 10.0)
    namespace["hw"] = nb.Hardware("NVIDIA H100 80GB HBM3", (9, 0), None)
    found = namespace["benchmark"](rounds=1)
    tokens = cfg.batch_size * cfg.seq_len
    assert [e["d_model"] for e in found["estimate"]] == [cfg.d_model, 512, 1024, 2048]
    by_datasheet = nb.linear_estimate(nb.sized_config(cfg, 512, 4), tokens, "H100")
    assert found["estimate"][1] == by_datasheet
    out = capsys.readouterr().out
    assert "estimate for the H100" in out and "(linear layers only)" in out


def test_the_benchmark_times_section_4s_recipe_under_its_name_injected(nb, cfg):
    """The FP8 row is timed with the recipe training ran (run_recipe), not another."""
    timed_with = {}

    def median_step_ms(size_cfg, run_recipe, device):
        timed_with.setdefault(size_cfg.d_model, []).append(run_recipe)
        return 10.0

    namespace = benchmark_namespace(nb, cfg, median_step_ms)
    namespace["run_recipe"] = section_4s = object()
    found = namespace["benchmark"](rounds=1)
    assert timed_with[cfg.d_model] == [None, section_4s]  # BF16, then FP8 DelayedScaling
    assert [row["precision"] for row in found["rows"][:2]] == [
        "BF16 (TE)",
        "FP8 DelayedScaling (TE)",
    ]


def test_a_gpu_without_datasheet_figures_here_gets_no_estimate_injected(nb, cfg, capsys):
    namespace = benchmark_namespace(nb, cfg, lambda size_cfg, run_recipe, device: 10.0)
    namespace["hw"] = nb.Hardware("NVIDIA L40S", (8, 9), None)  # not Colab's L4
    assert namespace["benchmark"](rounds=1)["estimate"] == []
    assert (
        "NVIDIA L40S: beside the timings, the estimate for no GPU here" in capsys.readouterr().out
    )


def test_an_experiment_is_recorded_ran_skipped_or_failed_with_its_traceback(nb, capsys):
    experiments = {}
    nb.run_experiment(experiments, "a", None, lambda: {"x": 1})
    nb.run_experiment(experiments, "b", "needs a GPU", lambda: {"x": 2})
    nb.run_experiment(experiments, "c", None, lambda: 1 / 0)
    assert experiments["a"] == {"status": "ran", "reason": "", "x": 1}
    assert experiments["b"] == {"status": "skipped", "reason": "needs a GPU"}
    assert (
        experiments["c"]["status"] == "failed"
        and experiments["c"]["reason"] == "ZeroDivisionError: division by zero"
    )
    assert "Traceback" in experiments["c"]["traceback"] and "1 / 0" in experiments["c"]["traceback"]
    printed = capsys.readouterr().out
    assert (
        "Skipped: needs a GPU" in printed
        and "FAILED: ZeroDivisionError" in printed
        and "Traceback" in printed
    )


@pytest.fixture(scope="module")
def traces(nb):
    magnitudes = nb.activation_range_schedule()
    return {
        (n, algo): nb.scale_following(n, algo, magnitudes)
        for n in (16, 1024)
        for algo in ("max", "most_recent")
    }


def test_every_recipe_saturates_on_each_step_of_a_rising_range(traces):
    for trace in traces.values():
        assert trace["saturated"][0] == 0  # a scale of 1 covers the first step's amax of 1
        assert all(share > 0 for share in trace["saturated"][1:80])


def test_most_recent_ignores_the_history_length(traces):
    assert traces[(16, "most_recent")] == traces[(1024, "most_recent")]


def test_max_holds_a_spike_for_its_window_and_most_recent_chases_noise(nb, traces):
    spike = nb.SPIKE_STEP
    short, long, recent = traces[(16, "max")], traces[(1024, "max")], traces[(16, "most_recent")]
    assert short["scale"][spike + 20] > 2 * short["scale"][spike + 1]  # recovered after 16 steps
    assert long["scale"][-1] == pytest.approx(long["scale"][spike + 1])  # never, with 1024
    after = {
        name: sum(t["flushed"][spike + 1 :])
        for name, t in (("short", short), ("long", long), ("recent", recent))
    }
    assert after["long"] > after["short"] > after["recent"]
    on_plateau = {
        name: sum(s > 0 for s in t["saturated"][spike + 2 :])
        for name, t in (("short", short), ("recent", recent), ("long", long))
    }
    assert on_plateau["recent"] > 5 * max(1, on_plateau["short"]) and on_plateau["long"] == 0
