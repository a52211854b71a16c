"""Section 10.8: TE's other recipes as references, checked against hand-computed cases, against
torchao's MX reference, and (tests/te_stage) against TE's own Python references."""

import warnings

import pytest
import torch


def quantized(nb, x, *way):
    return nb.fake_quantize(torch.tensor(x, dtype=torch.float32), *way)


def test_current_scaling_maps_the_tensors_own_amax_to_the_formats_maximum(nb):
    way = None, "E4M3", nb.current("E4M3")
    out, saturated, flushed = quantized(nb, [[448.0, -0.3, 1e-3]], *way)
    assert out.tolist() == [[448.0, -0.3125, 0.001953125]]  # scale 1: section 4's casts
    assert (saturated, flushed) == (0.0, 0.0)
    out, _, _ = quantized(nb, [[2.0, 3e-3]], *way)  # scale 448 / 2: the small value survives
    assert out[0, 0] == pytest.approx(2.0, rel=1e-6) and out[0, 1] == pytest.approx(3e-3, rel=0.07)
    scale, undo = nb.current("E5M2")(torch.tensor(4.0))
    assert scale.item() == 57344 / 4 and undo.item() == pytest.approx(4 / 57344, rel=1e-7)


def test_block_scaling_gives_each_block_its_own_power_of_two_scale(nb):
    x = torch.cat([torch.full((1, 128), 3.0), torch.full((1, 128), 1e-3)], dim=1)
    scale, _ = nb.current("E4M3", power_of_two=True)(x.reshape(1, 1, 2, 128).abs().amax(dim=(1, 3)))
    assert scale.flatten().tolist() == [128.0, 262144.0]  # 448/3 = 149.3 -> 128; 448e3 -> 2^18
    out, _, flushed = nb.fake_quantize(x, (1, 128), "E4M3", nb.current("E4M3", power_of_two=True))
    # 3 x 128 = 384 is exact in E4M3; 1e-3 x 2^18 = 262.1 rounds to 256 (a step of 32 there)
    assert out[0, :128].eq(3.0).all() and out[0, 128:].eq(256 / 2**18).all() and flushed == 0
    per_tensor, _, flushed_whole = nb.fake_quantize(x, None, "E4M3", nb.current("E4M3"))
    assert flushed_whole == 0 and (per_tensor[0, 128:] != x[0, 128:]).any()  # one scale: coarser


def test_mxfp8_scales_are_powers_of_two_rounded_up_so_nothing_saturates(nb):
    scale, decode = nb.e8m0(torch.tensor([448.0, 449.0, 1.0, 0.0]))
    assert decode.tolist() == [1.0, 2.0, 2.0**-8, 2.0**-127]  # 1/448 rounded up: 2^-8; 0: E8M0's 0
    assert torch.equal(scale * decode, torch.ones(4))
    x = torch.linspace(-449, 449, 64).reshape(2, 32)
    _, saturated, _ = nb.fake_quantize(x, (1, 32), "E4M3", nb.e8m0)
    assert saturated == 0.0


def test_the_e2m1_grid_rounds_to_nearest_with_ties_to_even_codes_and_saturates_at_6(nb):
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert nb.round_e2m1(torch.tensor(grid)).tolist() == grid
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75])
    assert nb.round_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0]
    assert nb.round_e2m1(torch.tensor([7.0, -100.0, 0.3])).tolist() == [6.0, -6.0, 0.5]


def test_nvfp4_scales_each_block_in_e4m3_under_one_fp32_scale_and_flushes_small_values(nb):
    x = torch.tensor([[6.0 * 448] + [1.0] * 15 + [0.1] * 15 + [1.0]])  # two blocks of 16
    out, saturated, flushed = nb.fake_quantize(x, (1, 16), "E2M1", nb.nvfp4(x.abs().max()))
    assert out[0, 0] == 6.0 * 448 and saturated == 0.0  # the tensor's amax: exactly 6 x 448
    assert out[0, 1:16].tolist() == [0.0] * 15  # 1 / 448 < 0.25 (half of 0.5): flushed
    # the second block: 1 -> E4M3(1 / 6) = 0.171875 -> 1 / 0.171875 = 5.82 rounds to 6; 0.1 to 0.5
    assert out[0, 16].item() == pytest.approx(0.5 * 0.171875) and flushed == pytest.approx(15 / 32)


def test_block_recipes_pad_the_last_block_with_zeros(nb):
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    for name in nb.RECIPE_CHECKS:
        out, *_ = nb.fake_quantize(x, *nb.reference_recipe(name, "input", x))
        assert out.shape == x.shape and nb.sqnr_db(x, out) > 10


def test_torchaos_mx_reference_agrees_bitwise_with_rceil_and_not_with_its_default_floor(nb):
    """torchao's MX reference (torchao.prototype.mx_formats) with ScaleCalculationMode.RCEIL
    computes TE's scale: 2^ceil(log2(amax / 448)). Its default, FLOOR (the OCP MX spec's
    2^(floor(log2 amax) - 8)), can pick a scale one binade smaller, and then saturates."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.exp(2 * torch.randn(64, 256, generator=g))
    x[:, :32] = 0  # a zero block: E8M0's smallest scale, 2^-127, in both
    ours, _, _ = nb.fake_quantize(x, (1, 32), "E4M3", nb.e8m0)
    decode = nb.e8m0(x.reshape(64, 8, 32).abs().amax(dim=-1))[1]
    scale, data = mx.to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    assert torch.equal(scale.float().reshape(64, 8), decode)
    assert torch.equal(data.float().reshape(64, 8, 32) * decode[..., None], ours.reshape(64, 8, 32))
    floor_scale, _ = mx.to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)
    assert (floor_scale.float().reshape(64, 8) < decode).any()
