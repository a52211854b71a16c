"""Delayed scaling from scratch: TE's fused update rule, the casts, and the reference linear."""

import dataclasses
import math

import numpy as np
import pytest
import torch
import yaml

CPU = torch.device("cpu")
F32_MAX = torch.finfo(torch.float32).max


def update(nb, history, scale, *, fp8_max=448.0, margin=0, algo="max"):
    history, scale = torch.tensor(history), torch.tensor(scale)
    nb.update_scales(history, scale, fp8_max, margin, algo)
    return history, scale


def test_the_update_rolls_the_history_so_the_newest_amax_is_last_and_row_0_is_clear(nb):
    # row 0 holds this step's amax (4); rows 1..3 are older steps, the oldest first
    history, _ = update(nb, [[4.0], [3.0], [5.0], [2.0]], [1.0])
    assert history.flatten().tolist() == [0.0, 5.0, 2.0, 4.0]  # the oldest (3) dropped out


def test_max_takes_the_whole_window_most_recent_only_this_step(nb):
    assert update(nb, [[4.0], [3.0], [5.0], [2.0]], [1.0])[1].item() == pytest.approx(448 / 5)
    _, scale = update(nb, [[4.0], [3.0], [5.0], [2.0]], [1.0], algo="most_recent")
    assert scale.item() == pytest.approx(448 / 4)


def test_a_tensor_not_cast_this_step_keeps_its_scale_and_its_history(nb):
    """TE's fused kernel skips the roll when the step's amax is 0 (the Python fallback rolls)."""
    history, scale = update(nb, [[0.0, 2.0], [3.0, 1.0], [5.0, 4.0]], [7.5, 1.0])
    assert history[:, 0].tolist() == [0.0, 3.0, 5.0] and scale[0].item() == 7.5
    assert history[:, 1].tolist() == [0.0, 4.0, 2.0] and scale[1].item() == pytest.approx(448 / 4)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_an_infinite_amax_keeps_the_old_scale(nb, algo):
    assert update(nb, [[math.inf], [1.0]], [7.5], algo=algo)[1].item() == 7.5


def test_a_nan_amax_is_skipped_by_max_as_the_kernels_fmaxf_does(nb):
    history, scale = update(nb, [[math.nan], [2.0], [4.0]], [1.0])
    assert scale.item() == pytest.approx(448 / 4) and math.isnan(history[-1].item())
    assert update(nb, [[math.nan], [2.0]], [7.5], algo="most_recent")[1].item() == 7.5


def test_an_amax_too_small_for_fp32_gives_the_largest_fp32_scale(nb):
    assert update(nb, [[1e-45], [0.0]], [1.0])[1].item() == F32_MAX


def test_the_margin_divides_fp8_max_by_a_power_of_two(nb):
    _, scale = update(nb, [[3.0], [0.0]], [1.0], fp8_max=57344.0, margin=3)
    assert scale.item() == np.float32(57344 * 2.0**-3) / np.float32(3.0)


def test_the_scale_is_the_correctly_rounded_division_like_the_kernels(nb):
    """fp8_max / amax in IEEE float32; torch's scalar / tensor is a reciprocal-multiply instead."""
    amax = torch.rand(10_000, generator=torch.Generator().manual_seed(0)) * 100 + 1e-3
    history, scale = amax[None].clone(), torch.ones_like(amax)
    nb.update_scales(torch.cat([history, torch.zeros_like(history)]), scale, 448.0)
    expected = np.float32(448.0) / amax.numpy()
    assert np.array_equal(scale.numpy(), expected)
    assert not torch.equal(448.0 / amax, torch.from_numpy(expected))  # the trap, for the record


def state(nb, n=1, history=4):
    return nb.fp8_state(n, history, CPU)


def test_e4m3_casts_saturate_at_448_and_report_the_amax(nb):
    x_fp8, amax = nb.quantize(torch.tensor([1000.0, -500.0, 3.0, 1e-4]), torch.tensor(1.0), "E4M3")
    assert x_fp8.dtype == torch.float8_e4m3fn and amax.item() == 1000.0
    assert x_fp8.float().tolist() == [448.0, -448.0, 3.0, 0.0]


def test_e5m2_reaches_57344_and_saturates_instead_of_overflowing(nb):
    x_fp8, _ = nb.quantize(torch.tensor([50000.0, 1e6, -1e6]), torch.tensor(1.0), "E5M2")
    assert x_fp8.dtype == torch.float8_e5m2
    assert x_fp8.float().tolist() == [49152.0, 57344.0, -57344.0]  # no inf


def test_the_scale_is_applied_before_the_cast(nb):
    x_fp8, _ = nb.quantize(torch.tensor([0.01, -0.005]), torch.tensor(448 / 0.01), "E4M3")
    assert x_fp8.float().tolist() == [448.0, -224.0]


def test_hybrid_is_e4m3_forward_and_e5m2_for_gradients(nb):
    assert nb.fp8_formats(nb.ReferenceRecipe()) == {"forward": "E4M3", "backward": "E5M2"}
    e4m3 = nb.ReferenceRecipe(fp8_format=nb.ReferenceFormat.E4M3)
    assert nb.fp8_formats(e4m3) == {"forward": "E4M3", "backward": "E4M3"}
    assert nb.FP8_MAX == {"E4M3": 448.0, "E5M2": 57344.0}


def test_a_reference_cast_folds_its_amax_into_row_0_and_records_what_it_lost(nb):
    s, fp8 = state(nb), nb.ReferenceFP8(nb.ReferenceRecipe())
    s.amax_history[0, 0] = 2000.0  # a larger amax from an earlier cast in this step
    x = torch.tensor([1000.0, -500.0, 3.0, 1e-4])
    fp8.cast(x, s, 0, "forward")
    assert s.stats[:2, 0].tolist() == [50.0, 25.0] and s.stats[2:, 0].isnan().all()  # two only
    with nb.taking_stats(len(nb.REFERENCE_STATS)):  # all of them, as 10.11's run takes them
        fp8.cast(x, s, 0, "forward")
    assert s.amax_history[0, 0] == 2000.0 and s.amax_history[1:].abs().sum() == 0
    stats = dict(zip(nb.REFERENCE_STATS, s.stats[:, 0].tolist(), strict=True))
    assert stats["overflows%"] == 50.0 and stats["underflows%"] == 25.0  # saturated; 1e-4 flushed
    assert stats["scale_inv"] == 1.0 and stats["cur_amax"] == 1000.0  # the scale used; amax(x)
    assert stats["mse"] == pytest.approx(((1000 - 448) ** 2 + (500 - 448) ** 2) / 4)
    assert stats["dynamic_range"] == pytest.approx(math.log2(1000 / 1e-4))
    assert stats["fp8_current_scaling_underflows%"] == 25.0  # scale 448 / 1000: 1e-4 still flushes


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
def test_the_reference_counts_flushed_values_as_te_does_non_zeros_that_cast_to_zero(nb, fmt):
    """TE's underflows% (stats_computation.py): count_nonzero(x) - count_nonzero(its FP8 cast)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.exp(4 * torch.randn(4096, generator=g))
    x[::7] = 0.0  # zeros stay zeros: not flushed
    for scale in (1.0, 448 / x.abs().max().item(), 1e-3, 3.7):
        scale = torch.tensor(scale)
        x_fp8 = nb.quantize(x, scale, fmt)[0]
        te_count = (x.count_nonzero() - x_fp8.float().count_nonzero()) / x.numel() * 100
        assert nb.cast_stats(x, x_fp8, scale, fmt)[1] == te_count


def test_fp8_matmul_on_a_cpu_computes_what_scaled_mm_computes_on_the_fp8_operands(nb):
    """On a CPU the reference's GEMM is FP32 arithmetic on the FP8 values (oneDNN's FP8 kernel is
    its slow reference one on CPUs without AMX-FP16); it must equal torch._scaled_mm's result."""
    s, fp8 = state(nb, n=2), nb.ReferenceFP8(nb.ReferenceRecipe())
    s.scale[:] = torch.tensor([64.0, 16.0])
    a, a_inv = fp8.cast(torch.randn(32, 48), s, 0, "forward")
    b, b_inv = fp8.cast(torch.randn(48, 24), s, 1, "backward")
    assert (a.dtype, b.dtype) == (torch.float8_e4m3fn, torch.float8_e5m2)
    column_major = b.t().contiguous().t()
    expected = torch._scaled_mm(a, column_major, a_inv, b_inv, out_dtype=torch.float32)
    torch.testing.assert_close(nb.fp8_matmul(a, a_inv, b, b_inv), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", ["HYBRID", "E4M3"])
def test_the_reference_linear_beats_20_db_forward_and_backward(nb, fmt):
    torch.manual_seed(0)
    layer, x, dy = nb.TwinLinear(128, 96), torch.randn(256, 128), torch.randn(256, 96) * 1e-3
    recipe = nb.ReferenceRecipe(fp8_format=nb.ReferenceFormat[fmt], amax_history_len=16)

    def run(fp8):
        x_ = x.clone().requires_grad_()
        with nb.reference_autocast(enabled=fp8, recipe=recipe):
            y = layer(x_)
        y.backward(dy)
        grads = (y.detach(), x_.grad, layer.weight.grad.clone(), layer.bias.grad.clone())
        layer.zero_grad()
        return grads

    run(fp8=True)  # one step to calibrate: delayed scaling starts from a scale of 1
    for name, high, low in zip(("y", "dx", "dw", "db"), run(False), run(True), strict=True):
        assert nb.sqnr_db(high, low) > 20, name


def tiny_model(nb, cfg, fp8_head=False):
    torch.manual_seed(0)
    return nb.CausalLM(dataclasses.replace(cfg, n_layers=1), CPU, fp8_head=fp8_head)


def fp8_step(nb, cfg, model, grad=True, recipe=None):
    tokens = nb.training_batch(cfg, torch.Generator().manual_seed(0))
    with (
        torch.set_grad_enabled(grad),
        nb.reference_autocast(recipe=recipe or nb.ReferenceRecipe(amax_history_len=16)),
    ):
        loss = torch.nn.functional.cross_entropy(
            model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
        )
    if grad:
        loss.backward()


def test_state_appears_on_the_first_fp8_forward_in_tes_layout(nb, cfg):
    model = tiny_model(nb, cfg)
    assert list(nb.fp8_tensors(model)) == []
    fp8_step(nb, cfg, model)
    labels = [label for label, *_ in nb.fp8_tensors(model)]
    assert labels[:3] == [
        f"layers.0.self_attention.layernorm_qkv.gemm/{r}"
        for r in ("input", "weight", "grad_output")
    ]
    assert labels[6:12] == [
        f"layers.0.layernorm_mlp.{g}/{r}"
        for g in ("fc1", "fc2")
        for r in ("input", "weight", "grad_output")
    ]
    assert labels[-1] == "layers.0.layernorm_mlp.fc2/grad_output" and len(labels) == 12  # no head
    mlp = model.layers[0].layernorm_mlp.fp8_meta
    assert mlp["num_gemms"] == 2 and mlp["scaling_fwd"].amax_history.shape == (16, 6)
    assert mlp["scaling_bwd"].amax_history.shape == (16, 4)


def test_every_used_slot_updates_once_per_step_in_both_directions(nb, cfg):
    model = tiny_model(nb, cfg)
    for step in range(3):
        fp8_step(nb, cfg, model)
        for label, s, slot, _ in nb.fp8_tensors(model):
            history = s.amax_history[:, slot]
            assert history[0] == 0, label  # the staging row is cleared by the update
            assert (history[-(step + 1) :] > 0).all(), label  # one new amax per step
            assert (history[1 : -(step + 1)] == 0).all(), label
            assert s.scale[slot] != 1.0, label
    for module in (m for m in model.modules() if "scaling_fwd" in getattr(m, "fp8_meta", {})):
        assert (module.fp8_meta["scaling_fwd"].amax_history[:, 2::3] == 0).all()  # output slots


def test_without_gradients_no_scale_updates_but_row_0_keeps_the_amax_as_tes_casts_do(nb, cfg):
    """TE 2.20.2: the forward update runs at the outermost te.autocast exit only with gradients
    on (quantization.py autocast_exit, ~779); its quantizers' amax is a view of row 0 of the
    history (make_quantizers, ~1449), where every cast max-accumulates, gradients or not."""
    model = tiny_model(nb, cfg)
    fp8_step(nb, cfg, model)
    before = [(s.amax_history.clone(), s.scale.clone()) for _, s, *_ in nb.fp8_tensors(model)]
    fp8_step(nb, cfg, model, grad=False)
    for (_, s, slot, direction), (history, scale) in zip(
        nb.fp8_tensors(model), before, strict=True
    ):
        assert torch.equal(s.scale, scale) and torch.equal(s.amax_history[1:], history[1:])
        assert bool(s.amax_history[0, slot] > 0) is (direction == "forward")  # staged, kept


def test_check_scale_update_agrees_with_the_reference_and_catches_a_broken_update(nb, cfg):
    model, recipe = tiny_model(nb, cfg), nb.ReferenceRecipe(amax_history_len=16)
    fp8_step(nb, cfg, model)
    assert nb.check_scale_update(model, recipe, lambda: fp8_step(nb, cfg, model)) == (0.0, True)

    def broken_step():  # an update that forgets to roll the history
        fp8_step(nb, cfg, model)
        for _, s, slot, _ in nb.fp8_tensors(model):
            s.amax_history[:, slot] = s.amax_history[:, slot].roll(1)

    assert nb.check_scale_update(model, recipe, broken_step)[1] is False


def test_check_scale_update_recomputes_the_rule_itself_so_a_wrong_rule_fails_it(
    nb, cfg, monkeypatch
):
    """The check does not call update_scales: a reference whose rule is wrong (a scale of
    fp8_max / amax / 2, as if the margin were 1) fails it, with the roll still right."""
    model, recipe = tiny_model(nb, cfg), nb.ReferenceRecipe(amax_history_len=16)
    fp8_step(nb, cfg, model)
    rule = nb.update_scales

    def halved(history, scale, fp8_max, margin=0, algo="max"):
        rule(history, scale, fp8_max / 2, margin, algo)

    monkeypatch.setattr(nb, "update_scales", halved)
    worst, rolled = nb.check_scale_update(model, recipe, lambda: fp8_step(nb, cfg, model))
    assert rolled and worst == pytest.approx(0.5)  # every scale half what the rule gives


def test_check_scale_update_fails_a_reference_whose_max_reads_only_row_0(nb, cfg, monkeypatch):
    """A wrong rule that is right on most steps: "max" computed from this step's amax alone
    (row 0, "most_recent"). The check, recomputing the window itself, catches it once an older
    amax in the window is larger than this step's."""
    model, recipe = tiny_model(nb, cfg), nb.ReferenceRecipe(amax_history_len=16)
    for _ in range(3):
        fp8_step(nb, cfg, model)
    for _, s, slot, _ in nb.fp8_tensors(model):  # one large old amax in every window
        s.amax_history[-2, slot] = 1e3 * s.amax_history[:, slot].max()
    rule = nb.update_scales

    def row_0_only(history, scale, fp8_max, margin=0, algo="max"):
        rule(history, scale, fp8_max, margin, "most_recent")

    assert nb.check_scale_update(model, recipe, lambda: fp8_step(nb, cfg, model)) == (0.0, True)
    monkeypatch.setattr(nb, "update_scales", row_0_only)
    worst, rolled = nb.check_scale_update(model, recipe, lambda: fp8_step(nb, cfg, model))
    assert rolled and worst > 100  # its scales ~1,000 times what the window gives


def test_the_state_sentence_gives_each_roles_range_of_scales_from_the_rows(nb, capsys):
    rows = [
        {"tensor": f"l{i}.gemm/{role}", "amax": 1.0, "window_max": 1.0, "scale": scale}
        for i, (role, scale) in enumerate(
            (("input", 90.0), ("input", 300.0), ("weight", 2e3), ("grad_output", 1e8))
        )
    ]
    nb.print_scale_spread(rows)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(
        "Scales: inputs 9.0e+01 to 3.0e+02, weights 2.0e+03 to 2.0e+03, grad_outputs 1.0e+08"
    )
    assert last.endswith("The largest is 1.1e+06 times the smallest.")


def test_the_state_table_reads_newest_amax_window_max_and_scale(nb, cfg):
    model = tiny_model(nb, cfg)
    for _ in range(2):
        fp8_step(nb, cfg, model)
    (row, *_), (_, s, slot, _) = nb.print_fp8_state(model), next(nb.fp8_tensors(model))
    assert row["amax"] == s.amax_history[-1, slot].item() > 0
    assert row["window_max"] == s.amax_history[:, slot].max().item() >= row["amax"]
    assert row["scale"] == s.scale[slot].item()


def test_snapshots_group_each_fp8_tensors_amax_scale_and_statistics_by_role(nb, cfg):
    model, snapshots = tiny_model(nb, cfg), []
    for _ in range(3):
        fp8_step(nb, cfg, model)
        snapshots.append(nb.fp8_snapshot(model))
    series = nb.by_role(snapshots, model)
    assert set(series) == {"input", "weight", "grad_output"}
    assert tuple(series["grad_output"]) == ("amax", "scale", *nb.REFERENCE_STATS)
    assert series["weight"]["amax"].shape == (3, 4)  # steps, the weights of 4 GEMMs (no head)
    assert (series["input"]["amax"] > 0).all()


def test_the_lm_head_in_fp8_beats_20_db_against_fp32_after_calibration(nb, cfg):
    model = tiny_model(nb, cfg, fp8_head=True)
    fp8_step(nb, cfg, model)  # the head's scales from its first amaxes
    batch = nb.training_batch(cfg, torch.Generator().manual_seed(3))
    result = nb.head_sqnr(model, batch, nb.ReferenceRecipe(amax_history_len=16))
    assert result["output_db"] > 20 and result["weight_grad_db"] > 20


def test_the_lm_head_runs_outside_fp8_unless_built_in_it(nb, cfg):
    """Issue 47: the nested `te.autocast(enabled=False)` leaves the head no FP8 state (no rows in
    section 8.1); fp8_head=True casts it as every other linear layer."""
    rows = {}
    for fp8_head in (False, True):
        model = tiny_model(nb, cfg, fp8_head)
        fp8_step(nb, cfg, model)
        rows[fp8_head] = [label for label, *_ in nb.fp8_tensors(model) if label.startswith("head")]
        assert ("recipe" in model.head.fp8_meta) is fp8_head
    assert rows == {False: [], True: [f"head.gemm/{r}" for r in nb.ROLES]}


def test_the_parser_reads_back_the_reference_statistics_written_in_tes_log_format(nb, cfg):
    """10.11 on a CPU: the reference's statistics of each step, written under TE's names in TE's
    format, then read by the parser that reads TE's own logs (the TE stage feeds it TE's lines)."""
    model, snapshots = tiny_model(nb, cfg), []
    with nb.taking_stats(len(nb.REFERENCE_STATS)):
        for _ in range(3):
            fp8_step(nb, cfg, model)
            snapshots.append(nb.fp8_snapshot(model))
    stats = nb.read_stats_log(nb.write_reference_stats(snapshots, model, nb.FP8_HEALTH_YAML))
    features = yaml.safe_load(nb.FP8_HEALTH_YAML)["fp8_health"]["transformer_engine"].values()
    asked = [stat for feature in features for stat in feature["stats"]]
    labels = [label for label, *_ in nb.fp8_tensors(model)]
    assert len(stats) == len(labels) * len(asked) == 12 * 8  # 4 GEMMs x 3 tensors; 8 statistics
    for column, label in enumerate(labels):
        layer, tensor = nb.te_debug_name(label).rsplit("_", 1)
        for stat in asked:
            row = 2 + nb.REFERENCE_STATS.index(stat.removesuffix("_min").removesuffix("_max"))
            written = {i: float(f"{s[row, column].item():.6g}") for i, s in enumerate(snapshots)}
            assert stats[layer, tensor, stat] == written, (label, stat)
    assert ("layers.0.self_attention.layernorm_linear_qkv", "activation", "mse") in stats
    assert ("layers.0.layernorm_mlp.fc2", "gradient", "underflows%") in stats
    assert all(v > 0 for (_, _, stat), d in stats.items() if stat == "cur_amax" for v in d.values())
    assert all(
        v > 0 for v in stats["layers.0.layernorm_mlp.fc2", "gradient", "scale_inv_min"].values()
    )


CURRENT = "fp8_current_scaling_underflows%"


def all_stats(nb, x, scale=1.0, fmt="E4M3"):
    scale = torch.tensor(scale)
    with nb.taking_stats(len(nb.REFERENCE_STATS)):
        stats = nb.cast_stats(x, nb.quantize(x, scale, fmt)[0], scale, fmt)
    return dict(zip(nb.REFERENCE_STATS, stats.tolist(), strict=True))


def test_an_all_zero_tensor_flushes_nothing_under_either_scaling(nb):
    """Current scaling's scale, fp8_max / amax, has no value at amax 0: TE takes 1 there."""
    found = all_stats(nb, torch.zeros(64))
    assert found["underflows%"] == found["fp8_current_scaling_underflows%"] == 0.0
    assert found["overflows%"] == found["mse"] == found["cur_amax"] == 0.0


def test_current_scalings_scale_is_as_tes_at_an_infinite_or_a_tiny_amax(nb):
    """TE's compute_scale_from_amax: 1 at an amax of inf, an infinite scale capped at FP32's
    maximum. Without either, every finite non-zero value counted as flushed, or the share was
    negative (a NaN cast: not zero)."""
    assert all_stats(nb, torch.tensor([math.inf, 1.0, 1e-4, 0.0]))[CURRENT] == 25.0  # 1e-4 only
    tiny = all_stats(nb, torch.tensor([1e-40, 5e-41, 0.0]))  # FP32 subnormals: 448 / 1e-40 = inf
    assert tiny[CURRENT] == 0.0 and tiny["underflows%"] == pytest.approx(200 / 3)


def test_a_run_no_tracker_reads_takes_no_statistics_and_a_tracked_one_its_first_two(nb, cfg):
    """The reference's statistics cost a quarter of its step: train() skips them untracked."""
    with nb.using(nb.standin):
        for track, taken in ((None, 0), (nb.fp8_snapshot, 2)):
            model = tiny_model(nb, cfg)
            nb.train(model, cfg, recipe=nb.delayed_scaling(cfg), steps=2, track=track)
            nan = {tuple(s.stats[:, i].isnan().tolist()) for _, s, i, _ in nb.fp8_tensors(model)}
            assert nan == {(False,) * taken + (True,) * (len(nb.REFERENCE_STATS) - taken)}
    assert nb.STATS_TAKEN == 2  # and after the run, the default again


def test_generation_inside_fp8_state_kept_leaves_the_state_bitwise_and_bare_it_does_not(nb, cfg):
    """Issue 59, 10.12, on the reference's real casts: section 9's generation fills row 0; inside
    fp8_state_kept it leaves every scale and history as it was; the next step folds row 0 in."""
    model, recipe = tiny_model(nb, cfg), nb.ReferenceRecipe(amax_history_len=16)
    fp8_step(nb, cfg, model)
    prompts = nb.training_batch(cfg, torch.Generator().manual_seed(1))[:, :8]
    with nb.using(nb.standin):
        nb.generate_greedy(model, prompts[:, :4], 2, recipe)  # row 0 not empty: kept as it is
    before = [t.clone() for t in nb.fp8_state_and_weights(model)]
    with nb.using(nb.standin), nb.fp8_state_kept(model):
        nb.generate_greedy(model, prompts, 4, recipe)
    after = nb.fp8_state_and_weights(model)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    with pytest.raises(ValueError), nb.using(nb.standin), nb.fp8_state_kept(model):
        nb.generate_greedy(model, prompts, 4, recipe)
        raise ValueError("an error inside: the row is put back all the same")
    after = nb.fp8_state_and_weights(model)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    with nb.using(nb.standin):
        nb.generate_greedy(model, prompts, 4, recipe)
    rows = [s.amax_history[0, i] for _, s, i, d in nb.fp8_tensors(model) if d == "forward"]
    assert all(row > 0 for row in rows) and torch.is_grad_enabled()
    staged = [s.amax_history[0].clone() for _, s, *_ in nb.fp8_tensors(model)]
    fp8_step(nb, cfg, model)  # the next step: row 0 went to the last row, max'd with the step's
    for (_, s, i, _), row in zip(nb.fp8_tensors(model), staged, strict=True):
        assert s.amax_history[-1, i] >= row[i]


def test_the_stand_in_casts_the_weights_once_given_is_first_microbatch_as_tes_linear_does(nb, cfg):
    """TE 2.20.2, linear.py: `update_ws = is_first_microbatch is None or is_first_microbatch`:
    True casts the weights and keeps the casts, False reuses them, None casts at every forward.
    So after a True forward, a weight changed in place does not reach a False forward's output
    (the kept cast does), and reaches a None forward's."""
    model, recipe = tiny_model(nb, cfg), nb.ReferenceRecipe(amax_history_len=16)
    fp8_step(nb, cfg, model)  # scales from a step
    tokens = nb.training_batch(cfg, torch.Generator().manual_seed(1))[:, :-1]
    with torch.no_grad(), nb.reference_autocast(recipe=recipe):
        cast_once = model(tokens, is_first_microbatch=True)
        for layer in model.layers:
            layer.layernorm_mlp.fc2_weight.mul_(2.0)
        kept = model(tokens, is_first_microbatch=False)
        recast = model(tokens)
        kept_still = model(tokens, is_first_microbatch=False)  # a None forward keeps nothing
    assert torch.equal(kept, cast_once) and not torch.allclose(recast, cast_once)
    assert torch.equal(kept_still, cast_once)
