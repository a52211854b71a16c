"""The reference delayed-scaling implementation, checked against hand-computed expectations."""

import dataclasses
import math

import pytest
import torch

CPU = torch.device("cpu")
F32_MAX = torch.finfo(torch.float32).max


def update(nb, history, scale, *, fp8_max=448.0, margin=0, algo="max"):
    history = torch.tensor(history, dtype=torch.float32)
    scale = torch.tensor(scale, dtype=torch.float32)
    nb.delayed_scaling_update(history, scale, fp8_max, margin, algo)
    return history, scale


def test_update_rolls_the_history_so_the_newest_amax_is_last_and_row_0_is_empty(nb):
    # row 0 holds this step's amax (4); rows 1..3 are older steps, oldest first
    history, _ = update(nb, [[4.0], [3.0], [5.0], [2.0]], [1.0])
    assert history.flatten().tolist() == [0.0, 5.0, 2.0, 4.0]  # the oldest (3) dropped out


def test_max_takes_the_whole_window_most_recent_only_this_step(nb):
    _, scale = update(nb, [[4.0], [3.0], [5.0], [2.0]], [1.0], algo="max")
    assert scale.item() == pytest.approx(448 / 5)
    _, scale = update(nb, [[4.0], [3.0], [5.0], [2.0]], [1.0], algo="most_recent")
    assert scale.item() == pytest.approx(448 / 4)


def test_margin_divides_the_scale_by_a_power_of_two(nb):
    _, scale = update(nb, [[2.0], [0.0]], [1.0], fp8_max=57344.0, margin=3)
    assert scale.item() == pytest.approx(57344 / 2 / 8)


@pytest.mark.parametrize("amax", [0.0, math.inf, math.nan])
def test_zero_or_non_finite_amax_keeps_the_old_scale(nb, amax):
    _, scale = update(nb, [[amax], [0.0]], [7.5], algo="most_recent")
    assert scale.item() == 7.5


def test_an_amax_too_small_for_fp32_gives_the_largest_fp32_scale(nb):
    _, scale = update(nb, [[1e-45], [0.0]], [1.0])
    assert scale.item() == F32_MAX


def test_each_tensor_has_its_own_column(nb):
    history, scale = update(nb, [[1.0, 8.0], [2.0, 0.0]], [1.0, 1.0])
    assert scale.tolist() == pytest.approx([448 / 2, 448 / 8])
    assert history.tolist() == [[0.0, 0.0], [1.0, 8.0]]


def state(nb, n=1, history=4):
    return nb.DelayedScalingState(n, history, CPU)


def test_e4m3_saturates_at_448_and_records_amax_and_shares(nb):
    s = state(nb)
    x = torch.tensor([1000.0, -500.0, 3.0, 1e-4])
    x_fp8, scale_inv = nb.quantize(x, s, 0, "E4M3")
    assert x_fp8.dtype == torch.float8_e4m3fn
    assert x_fp8.float().tolist() == [448.0, -448.0, 3.0, 0.0]
    assert s.amax_history[0, 0] == 1000.0 and s.amax_history[1:].abs().sum() == 0
    assert s.saturated[0] == 0.5 and s.flushed[0] == 0.25
    assert scale_inv == 1.0


def test_e5m2_reaches_57344_and_saturates_instead_of_overflowing(nb):
    s = state(nb)
    x_fp8, _ = nb.quantize(torch.tensor([50000.0, 1e6, -1e6]), s, 0, "E5M2")
    assert x_fp8.dtype == torch.float8_e5m2
    assert x_fp8.float().tolist() == [49152.0, 57344.0, -57344.0]  # no inf


def test_the_scale_is_applied_before_the_cast(nb):
    s = state(nb)
    s.scale[0] = 448 / 0.01
    x_fp8, scale_inv = nb.quantize(torch.tensor([0.01, -0.005]), s, 0, "E4M3")
    assert x_fp8.float().tolist() == [448.0, -224.0]
    assert (x_fp8.float() * scale_inv).tolist() == pytest.approx([0.01, -0.005])


def test_hybrid_is_e4m3_forward_e5m2_backward(nb):
    assert nb.fp8_formats("HYBRID") == ("E4M3", "E5M2")
    assert nb.fp8_formats("E4M3") == ("E4M3", "E4M3")
    assert nb.FP8_MAX == {"E4M3": 448.0, "E5M2": 57344.0}


def test_fp8_matmul_on_cpu_is_scaled_mm_and_equals_the_dequantised_product(nb):
    s = state(nb, n=2)
    s.scale[0], s.scale[1] = 64.0, 16.0
    a, a_inv = nb.quantize(torch.randn(32, 48), s, 0, "E4M3")
    b, b_inv = nb.quantize(torch.randn(48, 24), s, 1, "E5M2")
    nb.FP8_GEMMS_RUN.clear()
    product = nb.fp8_matmul(a, a_inv, b, b_inv)
    assert list(nb.FP8_GEMMS_RUN) == ["torch._scaled_mm on FP8 inputs"]
    expected = (a.float() * a_inv) @ (b.float() * b_inv)
    torch.testing.assert_close(product, expected, rtol=1e-5, atol=1e-5)


def sqnr(nb, reference, approximation):
    return nb.sqnr_db(reference, approximation)


@pytest.mark.parametrize("fmt", ["HYBRID", "E4M3"])
def test_reference_linear_forward_and_backward_beat_20_db(nb, fmt):
    torch.manual_seed(0)
    layer = nb.TwinLinear(128, 96)
    x = torch.randn(256, 128)
    dy = torch.randn(256, 96) * 1e-3
    recipe = nb.ReferenceRecipe(fp8_format=fmt, amax_history_len=16)

    def run(fp8):
        x_ = x.clone().requires_grad_()
        context = nb.ReferenceFP8Autocast(recipe) if fp8 else nb.contextlib.nullcontext()
        with context:
            y = layer(x_)
        y.backward(dy)
        grads = (y.detach(), x_.grad, layer.weight.grad.clone(), layer.bias.grad.clone())
        layer.zero_grad()
        return grads

    run(fp8=True)  # one step to calibrate: delayed scaling starts from scale 1
    for name, high, low in zip(("y", "dx", "dw", "db"), run(False), run(True), strict=True):
        assert sqnr(nb, high, low) > 20, name


def tiny_model(nb, cfg):
    torch.manual_seed(0)
    return nb.build_model(dataclasses.replace(cfg, n_layers=1), "torch", CPU)


def fp8_step(nb, cfg, model, grad=True):
    tokens = nb.training_batch(cfg, nb.seeded_generator(0, CPU))
    autocast = nb.make_autocast(nb.Plan("torch", nb.REFERENCE_FP8, ""), cfg, CPU)
    with torch.set_grad_enabled(grad):
        loss = nb.lm_loss(model, tokens, autocast)
        if grad:
            loss.backward()


def test_state_appears_on_the_first_fp8_forward_with_te_layout(nb, cfg):
    model = tiny_model(nb, cfg)
    assert nb.fp8_modules(model) == []
    fp8_step(nb, cfg, model)
    modules = dict(nb.fp8_modules(model))
    assert list(modules) == [
        "layers.0.self_attention.layernorm_qkv",
        "layers.0.self_attention.proj",
        "layers.0.layernorm_mlp",
        "head",
    ]
    mlp = modules["layers.0.layernorm_mlp"].fp8_meta
    assert mlp["num_gemms"] == 2
    assert mlp["scaling_fwd"].amax_history.shape == (cfg.amax_history_len, 6)
    assert mlp["scaling_bwd"].amax_history.shape == (cfg.amax_history_len, 4)
    labels = [t.label for t in nb.fp8_tensors(model) if t.module == "layers.0.layernorm_mlp"]
    assert labels == [
        f"layers.0.layernorm_mlp.{g}/{r}"
        for g in ("fc1", "fc2")
        for r in ("input", "weight", "grad_output")
    ]


def test_every_used_slot_updates_once_per_step_in_both_directions(nb, cfg):
    model = tiny_model(nb, cfg)
    for step in range(3):
        fp8_step(nb, cfg, model)
        for t in nb.fp8_tensors(model):
            history = t.state.amax_history[:, t.slot]
            assert history[0] == 0, t.label  # staging row emptied by the update
            assert (history[-(step + 1) :] > 0).all(), t.label  # one new amax per step
            assert (history[1 : -(step + 1)] == 0).all(), t.label
            assert t.state.scale[t.slot] != 1.0, t.label
        unused = [m.fp8_meta["scaling_fwd"].amax_history[:, 2] for _, m in nb.fp8_modules(model)]
        assert all((h == 0).all() for h in unused)  # output slots: we never emit FP8


def test_no_scale_updates_without_gradients(nb, cfg):
    model = tiny_model(nb, cfg)
    fp8_step(nb, cfg, model)
    before = [(t.state.amax_history.clone(), t.state.scale.clone()) for t in nb.fp8_tensors(model)]
    fp8_step(nb, cfg, model, grad=False)
    for t, (history, scale) in zip(nb.fp8_tensors(model), before, strict=True):
        assert torch.equal(t.state.scale, scale)
        assert torch.equal(t.state.amax_history[1:], history[1:])  # only the staging row moved


def test_reference_autocasts_do_not_nest(nb):
    recipe = nb.ReferenceRecipe()
    with nb.ReferenceFP8Autocast(recipe), pytest.raises(RuntimeError, match="do not nest"):
        with nb.ReferenceFP8Autocast(recipe):
            pass


def test_check_scale_update_agrees_with_the_reference_and_catches_a_broken_update(nb, cfg):
    model = tiny_model(nb, cfg)
    fp8_step(nb, cfg, model)
    worst, rolled = nb.check_scale_update(model, cfg, lambda: fp8_step(nb, cfg, model))
    assert worst == 0.0 and rolled

    def broken_step():  # a step whose update forgets to roll the history
        fp8_step(nb, cfg, model)
        for t in nb.fp8_tensors(model):
            t.state.amax_history[:, t.slot] = t.state.amax_history[:, t.slot].roll(1)

    assert nb.check_scale_update(model, cfg, broken_step)[1] is False


def test_tracker_records_only_where_fp8_runs(nb, cfg):
    model = tiny_model(nb, cfg)
    tracker = nb.FP8Tracker(model, every=2)
    tracker(0)
    assert tracker.series() is None
    for step in range(4):
        fp8_step(nb, cfg, model)
        tracker(step)
    series = tracker.series()
    assert tracker.steps == [0, 2]
    assert series["amax"].shape == (2, len(tracker.labels)) == series["flushed"].shape
    assert (series["amax"] > 0).all() and not series["saturated"].isnan().any()


def test_head_sqnr_against_fp32_beats_20_db_after_calibration(nb, cfg):
    model = tiny_model(nb, cfg)
    fp8_step(nb, cfg, model)
    result = nb.head_sqnr(model, cfg, CPU, nb.fp8_only_autocast("reference", cfg))
    assert result["output_db"] > 20 and result["weight_grad_db"] > 20
