"""Transformer Engine's own code, run on the notebook's TE calls (see conftest.py)."""

import ast
import dataclasses
import inspect

import pytest
import torch
import transformer_engine.common.recipe as te_recipes
import transformer_engine.pytorch as te
import transformer_engine_torch as tex
from conftest import cuda_device
from notebook_source import notebook_cells
from transformer_engine.pytorch import quantization

CPU = torch.device("cpu")


def te_calls():
    """Every call the notebook makes on TE: te.X(...), DelayedScaling(...), te_recipes.X(...)."""
    for cell in notebook_cells():
        if cell["cell_type"] != "code":
            continue
        for node in ast.walk(ast.parse("".join(cell["source"]))):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name.startswith(("te.", "te_recipes.")) or name in ("DelayedScaling", "Format"):
                yield name, node


def resolve(name):
    if name == "DelayedScaling":
        return te_recipes.DelayedScaling
    obj = te if name.startswith("te.") else te_recipes
    for part in name.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(
    "name, node", list(te_calls()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_te_call_in_the_notebook_exists_and_takes_its_arguments(name, node):
    if name.startswith("te_recipes.") and name.split(".")[1] == "name":  # getattr(te_recipes, name)
        return
    target = resolve(name)
    positional = [None] * sum(not isinstance(a, ast.Starred) for a in node.args)
    keywords = {k.arg: None for k in node.keywords if k.arg is not None}
    if isinstance(target, type):
        target = target.__init__ if target.__init__ is not object.__init__ else target
        positional = [None, *positional] if target is not type else positional
    inspect.signature(target).bind(*positional, **keywords)


def test_a_misspelt_keyword_would_be_caught():
    """The check above is not vacuous: TE's signatures refuse a keyword they do not have."""
    with pytest.raises(TypeError):
        inspect.signature(te.TransformerLayer.__init__).bind(None, 1, 2, 3, attn_input_fmt="bshd")


def test_the_notebooks_te_model_builds_with_the_stand_ins_names_and_shapes(nb, cfg):
    with cuda_device():
        torch.manual_seed(cfg.seed)
        model = nb.CausalLM(cfg, te, CPU)
    weights = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    twin = nb.CausalLM(cfg, nb.standin, CPU).state_dict()
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in twin.items()}
    assert sum(p.numel() for p in model.parameters()) == nb.expected_parameter_count(cfg)
    assert [type(layer) for layer in model.layers] == [te.TransformerLayer] * cfg.n_layers


def test_tes_weights_load_strictly_into_the_stand_in_and_back(nb, cfg):
    with cuda_device():
        model = nb.CausalLM(cfg, te, CPU)
        back = nb.CausalLM(cfg, te, CPU)
    twin = nb.CausalLM(cfg, nb.standin, CPU)
    weights = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    twin.load_state_dict(weights, strict=True)
    nb.load_weights(back, twin.state_dict())  # TE's _extra_state is the only thing missing
    for key, value in back.state_dict().items():
        if not key.endswith("_extra_state"):
            assert torch.equal(value, model.state_dict()[key]), key


def test_the_composed_block_takes_a_transformer_layers_weights(nb, cfg):
    with cuda_device():
        layer = nb.CausalLM(dataclasses.replace(cfg, n_layers=1), te, CPU).layers[0]
        block = nb.ComposedTEBlock(cfg, CPU)
    nb.load_weights(block, layer.state_dict())
    names = {k for k in block.state_dict() if not k.endswith("_extra_state")}
    assert names == {k for k in layer.state_dict() if not k.endswith("_extra_state")}


@pytest.mark.parametrize(
    "capability, runtime, precision",
    [
        ((7, 5), "T4", "fp16"),
        ((8, 0), "A100", "bf16"),
        ((8, 9), "L4", "fp8"),
        ((9, 0), "H100 / H200", "fp8"),
        ((12, 0), "G4 (RTX PRO 6000)", "fp8"),
    ],
)
def test_the_plan_from_tes_own_checks_is_the_notebooks_table(nb, capability, runtime, precision):
    with cuda_device(capability):
        hw = nb.detect_hardware()
    plan, example = nb.choose_plan(hw), nb.EXAMPLE_RUNTIMES[runtime]
    assert (plan.precision, plan.backend) == (precision, nb.choose_plan(example).backend)
    assert hw.fp8_error == example.fp8_error  # TE's own words for the A100
    if precision == "fp8":  # what te.get_default_recipe() picks on this GPU
        assert hw.te_default_recipe == example.te_default_recipe


def test_blackwell_datacenter_gpus_get_fp8_and_tes_default_there_is_mxfp8(nb):
    with cuda_device((10, 0)):
        hw = nb.detect_hardware()
        others = {name: ok for name, ok, _ in nb.other_recipes_here()}
    assert nb.choose_plan(hw).precision == "fp8" and hw.te_default_recipe == "MXFP8BlockScaling"
    assert others == {
        "Float8CurrentScaling": True,
        "Float8BlockScaling": True,
        "MXFP8BlockScaling": True,
        "NVFP4BlockScaling": True,
    }


@pytest.mark.parametrize(
    "capability, fp8_rows",
    [
        ((8, 0), []),
        ((9, 0), ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"]),
        (
            (12, 0),
            ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "NVFP4BlockScaling"],
        ),
    ],
)
def test_the_benchmark_times_every_recipe_te_says_this_gpu_runs(nb, cfg, capability, fp8_rows):
    with cuda_device(capability):
        hw = nb.detect_hardware()
        rows = nb.benchmark_precisions(hw, nb.choose_plan(hw), te_recipes.DelayedScaling())
    labels = [label for label, *_ in rows]
    assert labels[:3] == ["FP32 (PyTorch)", "BF16 (PyTorch)", "BF16 (TE)"]
    assert labels[3:] == [f"FP8 {name} (TE)" for name in fp8_rows]


def test_nvfp4_on_sm12x_runs_without_the_hadamard_transform_and_stochastic_rounding(nb):
    recipe = nb.other_recipe("NVFP4BlockScaling", (12, 0))
    assert not recipe.fp4_quant_fwd_inp.random_hadamard_transform
    assert not any(
        q.stochastic_rounding for q in (recipe.fp4_quant_fwd_inp, recipe.fp4_quant_bwd_grad)
    )
    assert nb.other_recipe("NVFP4BlockScaling", (10, 0)).fp4_quant_fwd_inp.random_hadamard_transform


def test_the_notebooks_autocasts_enter_and_exit(nb, cfg):
    recipe = te_recipes.DelayedScaling(
        fp8_format=te_recipes.Format[cfg.fp8_format],
        amax_history_len=cfg.amax_history_len,
        amax_compute_algo=cfg.amax_compute_algo,
        margin=cfg.fp8_margin,
    )
    with cuda_device():
        with torch.autocast("cpu", dtype=torch.bfloat16), te.autocast(enabled=True, recipe=recipe):
            assert quantization.FP8GlobalStateManager.is_fp8_enabled()
        with te.autocast(enabled=False, recipe=None):  # what a BF16, FP16 or FP32 plan enters
            assert not quantization.FP8GlobalStateManager.is_fp8_enabled()
        with te.quantized_model_init(False, recipe, preserve_high_precision_init_val=True):
            pass
        with pytest.raises(RuntimeError, match="8.9 or higher"), cuda_device((8, 0)):
            with te.autocast(enabled=True, recipe=recipe):
                pass
    assert not quantization.FP8GlobalStateManager.is_fp8_enabled()
    nb.te.quantization.FP8GlobalStateManager.reset()  # what the benchmark calls before a TE row


def test_the_notebook_reads_each_fp8_tensor_from_the_slot_te_gives_it(nb, cfg):
    """fp8_tensors labels slot 3k (3k+1) of the forward state as GEMM k's input (weight), slot 2k
    of the backward state as its incoming gradient. TE's own enums and each module's own
    quantizer roles must say the same. On a GPU, TE fills fp8_meta at the first FP8 forward
    (init_fp8_metadata, with 2 GEMMs for LayerNormMLP, 1 otherwise); here that step is done with
    TE's own state objects, since their constructor allocates on "cuda" by default."""
    for k in range(3):
        assert int(getattr(tex.FP8FwdTensors, f"GEMM{k + 1}_INPUT")) == 3 * k
        assert int(getattr(tex.FP8FwdTensors, f"GEMM{k + 1}_WEIGHT")) == 3 * k + 1
        assert int(getattr(tex.FP8BwdTensors, f"GRAD_OUTPUT{k + 1}")) == 2 * k
    recipe = te_recipes.DelayedScaling()
    with cuda_device():
        model = nb.CausalLM(cfg, te, CPU)
    modules = dict(model.named_modules())
    for module in modules.values():
        if isinstance(module, (te.Linear, te.LayerNormLinear, te.LayerNormMLP)):
            n = 2 if isinstance(module, te.LayerNormMLP) else 1
            module.fp8_meta["num_gemms"] = n
            for key, mode, per_gemm in (
                ("scaling_fwd", "forward", 3),
                ("scaling_bwd", "backward", 2),
            ):
                module.fp8_meta[key] = quantization.DelayedScalingRecipeState(
                    recipe, mode=mode, num_quantizers=n * per_gemm, device=CPU
                )
    seen = set()
    for label, state, slot, direction in nb.fp8_tensors(model):
        name, role_label = label.split("/")[0].rsplit(".", 1)[0], label.split("/")[1]
        module, forward = modules[name], direction == "forward"
        assert state is module.fp8_meta["scaling_fwd" if forward else "scaling_bwd"]
        role = module.get_quantizer_roles(fwd=forward, num_quantizers=len(state.scale))[slot]
        assert role.tensor_type == role_label, (label, role)
        gemm = label.split("/")[0].rsplit(".", 1)[1]
        assert role.name.endswith(f".{gemm}") if gemm != "gemm" else role.name == module.name
        seen.add(label)
    assert len(seen) == 3 * (4 * cfg.n_layers + 1)  # 3 tensors of qkv, proj, fc1, fc2; head


def test_tes_state_has_the_layout_the_reference_keeps(nb):
    recipe = te_recipes.DelayedScaling(amax_history_len=16)
    for mode, n in (("forward", 6), ("backward", 4)):
        state = quantization.DelayedScalingRecipeState(
            recipe, mode=mode, num_quantizers=n, device=CPU
        )
        ours = nb.fp8_state(n, 16, CPU)
        assert (
            state.scale.shape == ours.scale.shape
            and state.amax_history.shape == ours.amax_history.shape
        )
        assert torch.equal(state.scale, ours.scale) and torch.equal(
            state.amax_history, ours.amax_history
        )


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("forward", [True, False])
def test_the_update_rule_matches_tes_own_python_update(nb, algo, margin, forward):
    """TE's default update is a fused CUDA kernel; its Python fallback (_amax_and_scale_update,
    used with NVTE_UNFUSED_FP8_UPDATE=1) runs here. Where both agree (every amax > 0 and finite)
    the notebook's rule must give the same histories and the same scales: the fallback divides
    by reciprocal-multiply, so scales may differ by one ulp. Where they differ (an amax of 0:
    the kernel skips the roll), the notebook follows the kernel; the CPU tests pin that down."""
    recipe = te_recipes.DelayedScaling(amax_history_len=16, amax_compute_algo=algo, margin=margin)
    generator = torch.Generator().manual_seed(margin)
    history = torch.rand(16, 24, generator=generator) * torch.logspace(-8, 3, 24) + 1e-12
    scale = torch.rand(24, generator=generator) + 0.5
    te_history, te_scale, our_history, our_scale = history.clone(), scale.clone(), history, scale
    fp8_max = quantization.get_fp8_max(recipe, forward)
    quantization._amax_and_scale_update(te_history, te_scale, fp8_max, recipe)
    nb.update_scales(our_history, our_scale, fp8_max, margin, algo)
    assert torch.equal(our_history, te_history)
    torch.testing.assert_close(our_scale, te_scale, rtol=2.5e-7, atol=0)
    assert fp8_max == nb.FP8_MAX[nb.fp8_formats(recipe)["forward" if forward else "backward"]]


def test_fused_adam_has_the_master_weight_calls_the_notebook_makes():
    assert "master_weights" in inspect.signature(te.optimizers.FusedAdam.__init__).parameters
    inspect.signature(te.optimizers.FusedAdam.initialize_state).bind(
        None, None, store_param_remainders=False
    )
    inspect.signature(te.optimizers.FusedAdam.set_scaled_state).bind(
        None, None, "master_param", None
    )
