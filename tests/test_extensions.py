"""Section 10: the experiment harness, the benchmark's arithmetic and skip rules, and what the
amax-history experiment shows."""

import pytest
import torch

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


def test_the_memory_estimate_counts_adams_temporaries_and_skips_the_articles_size_on_a_t4(
    nb, defaults
):
    big = nb.sized_config(nb.check_parameters(defaults), 2048, 12)
    needed = nb.estimate_training_bytes(big)
    assert needed > 20 * nb.expected_parameter_count(big)  # weights, grads, 2 moments, a temporary
    assert "needs about" in nb.size_skip_reason(needed, 14.7 * 2**30)  # a T4's 15 GB
    assert nb.size_skip_reason(needed, 22 * 2**30) is None  # an L4's 24 GB


def test_a_size_is_skipped_when_its_estimate_does_not_fit_with_a_20_percent_margin(nb):
    assert nb.size_skip_reason(10 * 2**30, 8 * 2**30) == "needs about 10.0 GiB; 8.0 GiB free"
    assert nb.size_skip_reason(9 * 2**30, 10 * 2**30) is not None
    assert nb.size_skip_reason(7.9 * 2**30, 10 * 2**30) is None


def test_available_memory_counts_reclaimable_page_cache(nb, monkeypatch, tmp_path):
    """MemAvailable, not free pages: a full page cache must not make sizes look unaffordable."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal: 8000 kB\nMemFree: 100 kB\nMemAvailable: 6000 kB\nCached: 5900 kB\n"
    )
    monkeypatch.setattr(nb, "open", lambda path: meminfo.open(), raising=False)
    assert nb.available_memory_bytes(CPU) == 6000 * 1024
    monkeypatch.undo()
    assert 0 < nb.available_memory_bytes(CPU)  # and this machine's own /proc/meminfo parses


@pytest.mark.parametrize(
    "runtime, labels",
    [
        ("CPU", ["FP32 (PyTorch)", "FP8 (reference)"]),
        ("T4", ["FP32 (PyTorch)", "FP16 (PyTorch)"]),
    ],
)
def test_the_benchmark_times_every_precision_a_runtime_without_te_has(nb, runtime, labels):
    hw = nb.EXAMPLE_RUNTIMES[runtime]
    assert [label for label, *_ in nb.benchmark_precisions(hw, nb.choose_plan(hw), None)] == labels


def test_training_a_fresh_model_times_its_steps_and_reports_the_loss(nb, cfg):
    numbers = nb.time_training_steps(cfg, nb.standin, None, None, CPU, warmup=1, repeats=3)
    assert numbers["step_ms"] > 0 and numbers["first_loss"] > numbers["last_loss"]


def row(label, d, layers, ms):
    return {"precision": label, "d_model": d, "n_layers": layers, "step_ms": ms, "status": "ran"}


def test_benchmark_findings_are_written_from_the_numbers(nb):
    rows = [row("BF16 (TE)", 128, 2, 2.0), row("FP8 DelayedScaling (TE)", 128, 2, 3.0)]
    rows += [row("BF16 (TE)", 2048, 12, 40.0), row("FP8 DelayedScaling (TE)", 2048, 12, 25.0)]
    rows += [{"precision": "FP32 (PyTorch)", "d_model": 2048, "n_layers": 12, "status": "skipped"}]
    small, large = nb.benchmark_findings(rows)
    assert small.startswith("d_model 128 x 2 layers: fastest is BF16 (TE)")
    assert "FP8 DelayedScaling (TE) is slower than BF16 (TE) (0.67x its speed)" in small
    assert "FP8 DelayedScaling (TE) is faster than BF16 (TE) (1.60x its speed)" in large


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


def test_the_peak_memory_helper_returns_the_result_and_no_peak_on_a_cpu(nb):
    assert nb.peak_memory_mb(CPU, lambda a, b: a + b, 1, 2) == (3, None)


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
        assert trace["saturated_pct"][0] == 0  # a scale of 1 covers the first step's amax of 1
        assert all(share > 0 for share in trace["saturated_pct"][1:80])


def test_most_recent_ignores_the_history_length(traces):
    assert traces[(16, "most_recent")] == traces[(1024, "most_recent")]


def test_max_holds_a_spike_for_its_window_and_most_recent_chases_noise(nb, traces):
    spike = nb.SPIKE_STEP
    short, long, recent = traces[(16, "max")], traces[(1024, "max")], traces[(16, "most_recent")]
    assert short["scale"][spike + 20] > 2 * short["scale"][spike + 1]  # recovered after 16 steps
    assert long["scale"][-1] == pytest.approx(long["scale"][spike + 1])  # never, with 1024
    after = {
        name: sum(t["flushed_pct"][spike + 1 :])
        for name, t in (("short", short), ("long", long), ("recent", recent))
    }
    assert after["long"] > after["short"] > after["recent"]
    on_plateau = {
        name: sum(s > 0 for s in t["saturated_pct"][spike + 2 :])
        for name, t in (("short", short), ("recent", recent), ("long", long))
    }
    assert on_plateau["recent"] > 5 * max(1, on_plateau["short"]) and on_plateau["long"] == 0
