"""Transformer Engine's own code, run on the notebook's TE calls (see conftest.py)."""

import ast
import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import pickle
import re
import types
from pathlib import Path
from unittest import mock

import pytest
import torch
import transformer_engine.common.recipe as te_recipes
import transformer_engine.pytorch as te
import transformer_engine_torch as tex
import yaml
from conftest import cuda_device
from example_runtimes import RECIPES_HEADER, RUNTIMES_HEADER, example_runtimes, tes_check
from notebook_source import markdown_cell, markdown_table, notebook_cells, write_cell_file
from transformer_engine.pytorch import quantization
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor
from transformer_engine.pytorch.utils import is_non_tn_fp8_gemm_supported

CPU = torch.device("cpu")


def te_calls():
    """Every call the notebook makes on TE: te.X(...), DelayedScaling(...), te_recipes.X(...),
    and fp8_ddp.py's (its cell is that file; it calls the notebook's cells as nb.X)."""
    for cell in notebook_cells():
        if cell["cell_type"] != "code":
            continue
        text = "".join(cell["source"])
        code = text.split("\n", 1)[1] if text.startswith("%%writefile ") else text
        for node in ast.walk(ast.parse(code)):
            if not isinstance(node, ast.Call) or isinstance(node.func, ast.Call):
                continue  # f(...)(g): the inner call f(...) is walked on its own
            name = ast.unparse(node.func).removeprefix("nb.")
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
    signature = inspect.signature(target)
    unpacked = any(k.arg is None for k in node.keywords)  # **mapping: its keys are not in the code
    (signature.bind_partial if unpacked else signature.bind)(*positional, **keywords)


def test_a_misspelt_keyword_would_be_caught():
    """The check above is not vacuous: TE's signatures refuse a keyword they do not have."""
    with pytest.raises(TypeError):
        inspect.signature(te.TransformerLayer.__init__).bind(None, 1, 2, 3, attn_input_fmt="bshd")


def test_the_notebooks_te_model_builds_with_the_stand_ins_names_and_shapes(nb, cfg):
    with cuda_device():
        torch.manual_seed(cfg.seed)
        model = nb.CausalLM(cfg, CPU)
    with nb.using(nb.standin):
        twin = nb.CausalLM(cfg, CPU).state_dict()
    shapes = [
        {k: v.shape for k, v in state.items() if not k.endswith("_extra_state")}
        for state in (model.state_dict(), twin)
    ]
    assert shapes[0] == shapes[1]
    fp8_states = [
        {k for k in state if k.endswith("_extra_state")} for state in (model.state_dict(), twin)
    ]
    assert fp8_states[1] < fp8_states[0]  # the stand-in's FP8 state under TE's names (issue 46)
    assert fp8_states[0] - fp8_states[1] == {
        "final_norm._extra_state",
        *(f"layers.{i}.self_attention.core_attention._extra_state" for i in range(cfg.n_layers)),
    }
    assert sum(p.numel() for p in model.parameters()) == nb.expected_parameter_count(cfg)
    assert [type(layer) for layer in model.layers] == [te.TransformerLayer] * cfg.n_layers


def test_tes_weights_load_strictly_into_the_stand_in_and_back(nb, cfg):
    with cuda_device():
        model = nb.CausalLM(cfg, CPU)
        back = nb.CausalLM(cfg, CPU)
    with nb.using(nb.standin):
        twin = nb.CausalLM(cfg, CPU)
    nb.load_weights(twin, model.state_dict())  # TE's LayerNorm and attention: no twin state
    nb.load_weights(back, twin.state_dict())  # TE's _extra_state is the only thing missing
    for key, value in back.state_dict().items():
        if not key.endswith("_extra_state"):
            assert torch.equal(value, model.state_dict()[key]), key


def test_tes_pickle_screen_reads_the_stand_ins_fp8_state_as_delayed_scaling_state(
    nb, cfg, monkeypatch
):
    """Issue 46: TE's own screen (should_load_extra_state_pickle) ignores the stand-in's empty
    `_extra_state` and refuses its pickled FP8 state unless the variable is set (as it refuses
    any pickle that names a class: this shows the variable, not the format)."""
    from transformer_engine.pytorch._extra_state import should_load_extra_state_pickle

    with nb.using(nb.standin):
        model = nb.CausalLM(cfg, CPU)
    proj = model.layers[0].self_attention.proj  # a te.Linear's twin
    assert (
        should_load_extra_state_pickle(proj.get_extra_state().numpy().tobytes(), "Linear") is False
    )
    tokens = nb.training_batch(cfg, torch.Generator().manual_seed(0))[:, :-1]
    with nb.using(nb.standin), nb.reference_autocast(recipe=nb.ReferenceRecipe()):
        model(tokens).sum().backward()
    payload = proj.get_extra_state().numpy().tobytes()
    monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)
    with pytest.raises(RuntimeError, match="NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1"):
        should_load_extra_state_pickle(payload, "Linear")
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    assert should_load_extra_state_pickle(payload, "Linear") is True


def test_a_te_linear_never_run_in_fp8_saves_an_empty_fp8_state(nb):
    """Issue 46: TE's own get_extra_state on a module built on a CPU: an empty uint8 tensor,
    which the stand-in's matches (and which TE's set_extra_state takes as nothing to load)."""
    with cuda_device():
        layer = te.Linear(16, 16, device="cpu")
    state = layer.state_dict()["_extra_state"]
    assert state.dtype == torch.uint8 and state.numel() == 0
    layer.set_extra_state(state)  # nothing to load: no pickle screened, no GPU touched
    with nb.using(nb.standin):
        twin = nb.standin.Linear(16, 16, device=CPU)
    assert torch.equal(twin.state_dict()["_extra_state"], state)


def test_tes_set_extra_state_refuses_a_pickled_fp8_state_without_the_variable(nb, cfg, monkeypatch):
    """Issue 46: what load_state_dict meets on TE: its set_extra_state screens the payload
    (here the stand-in's) before it unpickles anything. Past the screen, TE builds its state
    on the GPU (init_fp8_meta_tensors) and syncs it: not run here, since only "a CUDA device
    exists" may be patched. A stand-in payload from a CPU holds the stand-in's recipe, which
    TE's set_extra_state cannot use: TE loads checkpoints that TE saved."""
    with nb.using(nb.standin):
        model = nb.CausalLM(cfg, CPU)
    tokens = nb.training_batch(cfg, torch.Generator().manual_seed(0))[:, :-1]
    with nb.using(nb.standin), nb.reference_autocast(recipe=nb.ReferenceRecipe()):
        model(tokens).sum().backward()
    with cuda_device():
        layer = te.Linear(cfg.d_model, cfg.d_model, device="cpu")  # the projection's shape
    monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)
    with pytest.raises(RuntimeError, match="Refusing to load pickled Transformer Engine extra"):
        layer.set_extra_state(model.layers[0].self_attention.proj.get_extra_state())


class Allocations(torch.overrides.TorchFunctionMode):
    """Records the device each torch.ones or torch.zeros asks for, then lets it run as it is."""

    def __init__(self):
        super().__init__()
        self.devices = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.ones, torch.zeros):
            self.devices.append(torch.device((kwargs or {}).get("device") or "cpu"))
        return func(*args, **(kwargs or {}))


def test_load_checkpoint_takes_tes_fp8_state_to_the_gpu_on_te_and_to_a_cpu_in_the_stand_in(
    nb, cfg, tmp_path, monkeypatch
):
    """Issue 61: a checkpoint whose te.Linear holds FP8 state in TE's format (get_extra_state,
    module/base.py: the recipe, CPU copies of scale and amax_history each way, and fp8_meta's
    plain values as init_fp8_metadata leaves them after an FP8 forward, pickled in a byte
    tensor), read by load_checkpoint onto the CPU. TE's set_extra_state passes its screen (the
    gate open for that load), unpickles the state and builds it where init_fp8_meta_tensors
    builds it: DelayedScalingRecipeState allocates on torch.device("cuda"), whatever device the
    file was read onto (quantization.py), then copies the checkpoint's CPU tensors in. That
    allocation needs a GPU: here it fails, after asking for the CUDA device; the variable is as
    it was before the load. The same file on a CPU loads into the stand-in's te.Linear (TE
    importable: the pickle names TE's recipe): its scales and amax histories, on the CPU."""
    with cuda_device():
        layer = te.Linear(cfg.d_model, cfg.d_model, device="cpu")
    optimizer, schedule = nb.optimizer_and_schedule(layer, cfg, 8)  # section 7's, as 10.7's
    nb.save_checkpoint(path := tmp_path / "te.pt", layer, optimizer, schedule, torch.Generator(), 3)
    history, state = cfg.amax_history_len, torch.load(path, weights_only=True)
    recipe = nb.delayed_scaling(cfg)
    plain = {"fp8_checkpoint": True, "num_gemms": 1, "fp8_max_fwd": recipe.fp8_format.value.max_fwd}
    plain["fp8_max_bwd"] = recipe.fp8_format.value.max_bwd  # fp8_group (None) is not plain
    fp8 = {"recipe": recipe, "extra_fp8_variables": plain}
    fp8 |= {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(history, 3)}
    fp8 |= {"scale_bwd": torch.ones(2), "amax_history_bwd": torch.zeros(history, 2)}
    state["model"]["_extra_state"] = torch.frombuffer(
        bytearray(pickle.dumps(fp8)), dtype=torch.uint8
    )
    torch.save(state, path)
    monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)
    allocations = Allocations()
    with cuda_device(), allocations, pytest.raises((RuntimeError, AssertionError)):  # no GPU here
        nb.load_checkpoint(path, layer, optimizer, schedule, None)
    assert allocations.devices == [torch.device("cuda")]  # TE's first: the scales' tensor
    assert "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE" not in os.environ
    with nb.using(nb.standin):  # the same file on a CPU, into the stand-in's te.Linear
        twin = nb.standin.Linear(cfg.d_model, cfg.d_model, device=CPU)
    assert nb.load_checkpoint(path, twin, *nb.optimizer_and_schedule(twin, cfg, 8), None) == 3
    for key, value in fp8.items():
        if key.startswith(("scale_", "amax_history_")):
            direction = twin.fp8_meta[f"scaling_{key.rsplit('_', 1)[1]}"]
            loaded = getattr(direction, key.rsplit("_", 1)[0])
            assert torch.equal(loaded, value) and loaded.device == CPU, key
    assert twin.get_extra_state().numel() > 0  # loaded since: it saves its FP8 state again


def injected_step_passes(recipe):
    return None


def detect(nb, capability, cuda=None, one_step=injected_step_passes):
    """detect_hardware on a pretended GPU, with the notebook's own import verdict for it. Its one
    real FP8 step needs a GPU: its outcome is injected here (what TE would do is not tested),
    TE's checks decide the rest."""
    with cuda_device(capability, cuda), mock.patch.object(nb, "TE_ERROR", nb.import_te()[3]):
        return nb.detect_hardware(one_step)


def other_recipes(nb, capability, cuda=None):
    """section 10.7's (name, why not) for each recipe: TE's checks, each step's success injected."""
    with (
        cuda_device(capability, cuda),
        mock.patch.object(nb, "one_step_alone", injected_step_passes),
    ):
        return {name: why_not for name, _, why_not in nb.other_recipes_here.__wrapped__()}


CAPABILITIES = {"L4": (8, 9), "H100 / H200": (9, 0), "G4 (RTX PRO 6000)": (12, 0)}


@pytest.mark.parametrize("cuda", ["12.8", "13.0"])  # Colab's torch, and PyPI's
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
def test_tes_own_checks_give_the_facts_behind_10_1s_runtime_table(
    nb, capability, runtime, precision, cuda
):
    hw = detect(nb, capability, cuda)
    plan, example = nb.choose_plan(hw), example_runtimes(nb)[runtime]
    assert (plan.precision, plan.backend) == (precision, nb.choose_plan(example).backend)
    assert hw.fp8_error == example.fp8_error  # TE's own words for the A100
    if precision == "fp8":  # what te.get_default_recipe() picks on this GPU: 10.1's column
        assert hw.te_default_recipe == example.te_default_recipe
        table = markdown_table(RUNTIMES_HEADER, markdown_cell("### 10.1 "))
        assert {row[0]: row[4] for row in table}[runtime] == hw.te_default_recipe


@pytest.mark.parametrize("cuda", ["12.8", "13.0"])
@pytest.mark.parametrize("runtime", list(CAPABILITIES))
def test_the_recipe_table_is_what_tes_checks_say_with_each_cuda(nb, runtime, cuda):
    """Float8BlockScaling needs a torch built with CUDA 12.9+: not Colab's 12.8 torch."""
    recipes = other_recipes(nb, CAPABILITIES[runtime], cuda)
    runs = tuple(name for name, why_not in recipes.items() if why_not is None)
    columns = RECIPES_HEADER.strip("| ").split(" | ")[1:]  # the runtimes, as the table names them
    table = markdown_table(RECIPES_HEADER, markdown_cell("### 10.1 "))
    on = {row[0]: dict(zip(columns, row[1:], strict=True))[runtime] for row in table}
    admitted = ("yes", f"with CUDA {cuda} only")
    assert runs == tuple(name for name in on if tes_check(on[name]) in admitted)
    assert all(recipes[name] for name in set(recipes) - set(runs))  # TE's words for each other


def test_mxfp8_is_refused_on_12_0_in_tes_words(nb):
    """Float8BlockScaling passes on 12.0 (TE emulates it with MXFP8 GEMMs), MXFP8 itself not."""
    assert "not supported on 12.0+" in other_recipes(nb, (12, 0), "13.0")["MXFP8BlockScaling"]


@pytest.mark.parametrize("capability", [(9, 0), (12, 0)])
def test_with_colabs_cuda_12_8_torch_te_autocast_refuses_block_scaling_on_entry(capability):
    """What 10.1 and 10.7 say: TE's check fails with a CUDA 12.8 torch, and te.autocast raises
    its words on entry; with a CUDA 13.0 torch, it enters."""
    with cuda_device(capability, "12.8"), pytest.raises(RuntimeError, match="CUDA >= 12.9"):
        with te.autocast(recipe=te_recipes.Float8BlockScaling()):
            pass
    with cuda_device(capability, "13.0"), te.autocast(recipe=te_recipes.Float8BlockScaling()):
        pass


@pytest.mark.parametrize("retry_raises", [False, True])
def test_with_nvfp4s_default_failure_injected_it_is_tried_without_rht_and_stochastic_rounding(
    nb, capsys, retry_raises
):
    """10.7's retry, its logic only: each step's outcome is injected, so what TE does on a G4 is
    not tested here; TE's own NVFP4BlockScaling takes the two switches the retry sets. Only NVFP4
    is retried: a Float8BlockScaling step that raises keeps its recipe and its error."""

    def injected_step(recipe):
        if isinstance(recipe, te_recipes.Float8BlockScaling):
            return "E: block"
        if not isinstance(recipe, te_recipes.NVFP4BlockScaling):
            return None
        plain = recipe.disable_rht and recipe.disable_stochastic_rounding
        return "RuntimeError: retry" if plain and retry_raises else None if plain else "E: default"

    with cuda_device((12, 0), "13.0"), mock.patch.object(nb, "one_step_alone", injected_step):
        runs = {name: (r, why_not) for name, r, why_not in nb.other_recipes_here.__wrapped__()}
    recipe, why_not = runs["NVFP4BlockScaling without RHT and SR"]  # the name 10.9 labels it by
    assert recipe.disable_rht and recipe.disable_stochastic_rounding
    assert why_not == ("RuntimeError: retry" if retry_raises else None)
    said = "NVFP4BlockScaling failed: E: default; tried again without RHT and stochastic rounding"
    assert said in capsys.readouterr().out
    block, why_not = runs["Float8BlockScaling"]
    assert type(block) is te_recipes.Float8BlockScaling and why_not == "E: block"


def injected_delayed_scaling_failure(recipe):
    if isinstance(recipe, te_recipes.DelayedScaling):
        return "RuntimeError: cuBLAS error in the FP8 backward GEMM"
    return None


def test_with_a_delayed_scaling_failure_injected_on_12_0_the_plan_takes_tes_default_recipe(nb):
    hw = detect(nb, (12, 0), one_step=injected_delayed_scaling_failure)
    plan = nb.choose_plan(hw)
    assert (plan.precision, plan.recipe) == ("fp8", "Float8CurrentScaling")
    assert isinstance(hw.fp8_fallback, te_recipes.Float8CurrentScaling)
    assert "cuBLAS error in the FP8 backward GEMM" in plan.fallbacks["DelayedScaling"]
    assert "Float8CurrentScaling" in plan.reason


def test_with_an_fp8_step_failure_injected_where_tes_default_is_delayed_scaling_the_plan_is_bf16(
    nb,
):
    plan = nb.choose_plan(detect(nb, (9, 0), one_step=injected_delayed_scaling_failure))
    assert plan.precision == "bf16" and plan.recipe is None
    assert "cuBLAS error in the FP8 backward GEMM" in plan.fallbacks["FP8"]


def injected_fp8_failure(recipe):  # every FP8 step fails; the BF16 step (no recipe) runs
    return None if recipe is None else "RuntimeError: no kernel"


def test_with_failures_injected_for_tes_default_too_the_plan_is_bf16_with_both_errors(nb):
    plan = nb.choose_plan(detect(nb, (12, 0), one_step=injected_fp8_failure))
    assert (plan.precision, plan.backend) == ("bf16", "te")
    assert (
        plan.fallbacks["FP8"].count("no kernel") == 2
        and "Float8CurrentScaling" in plan.fallbacks["FP8"]
    )


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0), (12, 0)])
def test_where_tes_own_bf16_step_fails_injected_the_plan_is_bf16_on_pytorch_in_tes_words(
    nb, capability
):
    """Issue 60: a failure that is not FP8's (attention, a fused kernel) sent the plan to BF16 on
    TE, which runs the same code, unprobed. Every step fails here (injected): on the A100 the BF16
    step is the only one; elsewhere it follows the FP8 steps. Its words reach the plan."""
    steps = []

    def injected_failure(recipe):
        steps.append(type(recipe).__name__)
        return "RuntimeError: CUDA error: an illegal memory access was encountered"

    hw = detect(nb, capability, one_step=injected_failure)
    plan = nb.choose_plan(hw)
    assert (plan.precision, plan.backend) == ("bf16", "torch") and steps[-1] == "NoneType"
    assert hw.te_error.startswith("one BF16 step failed: RuntimeError: CUDA error")
    assert "illegal memory access" in plan.fallbacks["FP8"]
    default = {(8, 0): [], (12, 0): ["DelayedScaling", "Float8CurrentScaling"]}
    assert steps[:-1] == default.get(capability, ["DelayedScaling"])


def test_the_a100s_bf16_plan_on_te_is_confirmed_by_one_bf16_step_injected(nb):
    steps = []
    hw = detect(nb, (8, 0), one_step=lambda recipe: steps.append(recipe))
    assert steps == [None] and nb.choose_plan(hw).backend == "te" and hw.te_error is None


def test_where_te_failed_its_bf16_step_6_2s_stand_in_takes_tes_place_injected(nb):
    """detect_hardware sets TE_ERROR where TE's own BF16 step failed (every step's failure
    injected); 6.2's cell, which runs after section 4's, then swaps in the stand-in, as where TE
    never imported."""
    with cuda_device((9, 0)), mock.patch.object(nb, "TE_ERROR", None):
        hw = nb.detect_hardware(lambda recipe: "RuntimeError: injected")
        assert nb.TE_ERROR == hw.te_error == "one BF16 step failed: RuntimeError: injected"
        namespace = dict(vars(nb))
    run_cell("# @title The stand-in's DelayedScaling", namespace)
    assert namespace["te"] is namespace["standin"]
    assert namespace["DelayedScaling"] is namespace["ReferenceRecipe"]


def run_cell(start, namespace):
    """Execute the notebook's code cell whose source starts with `start` in `namespace`."""
    (cell,) = [c for c in notebook_cells() if "".join(c["source"]).startswith(start)]
    exec("".join(cell["source"]), namespace)  # noqa: S102 the notebook's own cell


def experiments_after_a_failed_probe(nb, cfg, capability):
    """Sections 7 to 10's own cells after one DelayedScaling step raised (injected) on a GPU of
    this capability: their training, TE's optimizer and the launch injected, to record the
    recipes they are given. What TE does with those recipes is not tested here."""
    hw, given = detect(nb, capability, one_step=injected_delayed_scaling_failure), []

    def train(model, cfg, recipe=None, dtype=None, label="", **kw):
        given.append((label, recipe, dtype))
        return types.SimpleNamespace(final_loss=1.0, seconds=1.0, mean_of="the last steps")

    def train_step(model, tokens, optimizer, recipe, dtype):
        given.append(("10.6 step", recipe, dtype))
        return torch.tensor(1.0)

    def built_with_weights(big, weights, weights_recipe, **init):
        given.append(("10.6 build", weights_recipe, None))
        return torch.nn.Linear(2, 2)

    with nb.using(nb.standin):
        initial_state = nb.CausalLM(cfg, CPU).state_dict()
    ns = dict(vars(nb), cfg=cfg, device=CPU, hw=hw, plan=nb.choose_plan(hw), model=None)
    ns |= {"train": train, "loss_change": str, "initial_state": initial_state}
    with cuda_device(capability):
        for start in ("recipe, dtype = delayed", "# @title The FP8 run:", "experiments, te_skip"):
            run_cell(start, ns)  # sections 7 and 8's runs, and 10's gates
        run_cell("def fp8_vs_high_precision", ns)
        ns["fp8_vs_high_precision_found"] = ns["fp8_vs_high_precision"]()
        run_cell("# @title Training with FP32", ns)
        adam = types.SimpleNamespace(FusedAdam=lambda p, lr, **kw: torch.optim.SGD(p, lr=lr))
        ns |= {"train_step": train_step, "built_with_weights": built_with_weights}
        ns |= {"te": types.SimpleNamespace(optimizers=adam, Float8Quantizer=te.Float8Quantizer)}
        ns |= {"start_fp8_bookkeeping": lambda model: None}
        if not ns["fp8_skip"]:
            ns["train_weights"](cfg, "fp8", steps=1)
        launch = mock.Mock(return_value=[])
        ns |= {"te": te, "device": torch.device("cuda"), "run_data_parallel": launch}
        ns["benchmark"] = dict  # the benchmark's skip only: its timing is injected
        run_cell("on_cpu = ", ns)
        run_cell("# @title The two-rank check", ns)
        ns["data_parallel_on_gpus"]()
    return ns, given


def test_with_a_delayed_scaling_failure_injected_on_12_0_every_experiment_takes_tes_default(
    nb, cfg
):
    """Issue 60: section 7 trains with TE's default recipe; section 8 runs the reference (TE's
    recipe keeps no amax history); 10.2 trains BF16 on TE beside section 7; 10.6 builds and
    trains with section 7's recipe; fp8_ddp.py is told it; 10.10 times it (its labels: issue 59's
    test); 10.12's FP8-weight serving, which needs DelayedScaling, is skipped saying so."""
    ns, given = experiments_after_a_failed_probe(nb, cfg, (12, 0))
    default, delayed = ns["run_recipe"], ns["recipe"]
    assert isinstance(default, te_recipes.Float8CurrentScaling) and default is ns["hw"].fp8_fallback
    assert given == [
        ("fp8", default, torch.bfloat16),  # section 7
        ("FP8 reference", delayed, None),  # section 8
        ("BF16 (TE)", None, torch.bfloat16),  # 10.2
        ("10.6 build", default, None),
        ("10.6 step", default, torch.bfloat16),
    ]
    assert ns["fp8_vs_high_precision_found"]["fp8"] == "FP8 Float8CurrentScaling (section 7)"
    assert ns["run_data_parallel"].call_args.args[3:] == ("--te-default-recipe",)
    assert ns["fp8_skip"] is None and ns["timing_skip"] is None
    assert ns["delayed_skip"] == "needs TE's DelayedScaling, not Float8CurrentScaling"


def test_with_a_delayed_scaling_failure_injected_on_9_0_every_fp8_experiment_says_why_not(nb, cfg):
    """TE's default there is DelayedScaling itself: the plan is BF16 on TE. Section 8 and 10.2's
    FP8 run is the reference, beside section 7's BF16; fp8_ddp.py runs the reference; 10.6, the
    benchmark and 10.12's serving are skipped with TE's words for the failed step."""
    ns, given = experiments_after_a_failed_probe(nb, cfg, (9, 0))
    assert ns["run_recipe"] is None and ns["plan"].precision == "bf16"
    assert given == [("bf16", None, torch.bfloat16), ("FP8 reference", ns["recipe"], None)]
    found = ns["fp8_vs_high_precision_found"]
    assert (found["fp8"], found["high_precision"]) == ("FP8 (reference)", "BF16")
    assert ns["run_data_parallel"].call_args.args[3:] == ("--reference",)
    assert "cuBLAS error in the FP8 backward GEMM" in ns["fp8_skip"]
    assert ns["fp8_skip"] in ns["timing_skip"] and ns["delayed_skip"] == ns["fp8_skip"]


def test_a_gpu_below_8_0_gets_no_te_and_trains_in_fp16_on_pytorch(nb):
    hw = detect(nb, (7, 5))
    assert hw.te_error and nb.choose_plan(hw).backend == "torch"


def test_blackwell_datacenter_gpus_get_fp8_and_tes_default_there_is_mxfp8(nb):
    hw = detect(nb, (10, 0), "13.0")
    assert nb.choose_plan(hw).precision == "fp8" and hw.te_default_recipe == "MXFP8BlockScaling"
    assert "(on a B200, 10.0, not a Colab runtime: MXFP8BlockScaling)" in " ".join(
        markdown_cell("### 10.1 ").split()
    )
    assert set(other_recipes(nb, (10, 0), "13.0").values()) == {None}  # every check passes


@pytest.mark.parametrize(
    "capability, keeps_transpose",
    [((8, 9), True), ((9, 0), True), ((10, 0), False), ((12, 0), True)],
)
def test_fp8_weights_keep_a_transpose_where_tes_fp8_gemms_are_tn_only(capability, keeps_transpose):
    """Section 10.6's claim, from TE's own check: L4, H100/H200 and G4 keep a transpose."""
    with cuda_device(capability):
        assert is_non_tn_fp8_gemm_supported() is not keeps_transpose


def test_fp8_weights_can_drop_their_cached_transpose():
    """Section 10.6 calls this after each FusedAdam step; TE's Float8Tensor must have it, and the
    fused FP8 update must be the path that writes the FP8 bytes in place (fused_adam.py)."""
    assert callable(Float8Tensor._reset_caches)
    source = inspect.getsource(te.optimizers.FusedAdam.step)
    assert "p_fp8_model.append(local_p._data.data)" in source and "_reset_caches" not in source


def test_tes_own_master_weight_cast_drops_the_transpose_as_the_notebook_does():
    """The notebook names TE's cast_master_weights_to_fp8 as making the same call."""
    from transformer_engine.pytorch.tensor import utils

    assert "model_weight._reset_caches()" in inspect.getsource(utils)
    assert callable(utils.cast_master_weights_to_fp8)


def delayed_scaling_linear():
    """A te.Linear with the delayed-scaling state its first FP8 forward gives it on a GPU
    (init_fp8_metadata); here made with TE's own state objects, which allocate on "cuda" by
    default."""
    with cuda_device():
        linear = te.Linear(32, 32, device=CPU)
    recipe = te_recipes.DelayedScaling(amax_history_len=4)
    linear.fp8_meta |= {"recipe": recipe, "fp8_group": None}
    for key, mode in (("scaling_fwd", "forward"), ("scaling_bwd", "backward")):
        linear.fp8_meta[key] = quantization.DelayedScalingRecipeState(
            recipe, mode=mode, num_quantizers=3 if mode == "forward" else 2, device=CPU
        )
    return linear


def tes_buffer():
    return quantization.FP8GlobalStateManager.quantization_state.global_amax_buffer


def test_after_tes_reset_a_module_that_ran_before_never_rejoins_tes_list(nb):
    """The bug start_fp8_bookkeeping works around: TE's add_fp8_tensors_to_global_buffer returns
    early when fp8_meta still holds its buffer key, so after reset() the module is left out."""
    manager, linear = quantization.FP8GlobalStateManager, delayed_scaling_linear()
    manager.add_fp8_tensors_to_global_buffer(linear.fp8_meta)
    assert tes_buffer()
    manager.reset()
    manager.add_fp8_tensors_to_global_buffer(linear.fp8_meta)  # what its next FP8 forward calls
    assert not tes_buffer()


def test_start_fp8_bookkeeping_empties_tes_list_and_lets_the_model_rejoin_it(nb):
    manager, linear, other = (
        quantization.FP8GlobalStateManager,
        delayed_scaling_linear(),
        delayed_scaling_linear(),
    )
    for module in (linear, other):
        manager.add_fp8_tensors_to_global_buffer(module.fp8_meta)
    nb.start_fp8_bookkeeping(torch.nn.Sequential(linear))
    assert not tes_buffer()  # the other model is gone from TE's list
    manager.add_fp8_tensors_to_global_buffer(linear.fp8_meta)
    assert [len(v) for v in tes_buffer().values()] == [1, 1]  # forward and backward: this one
    manager.reset()


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


def test_the_notebooks_forward_calls_its_head_with_tes_fp8_off_and_turns_it_back_on(nb, cfg):
    """Issue 47: section 6's forward, TE as `te`, inside an FP8 te.autocast: the head is called
    where TE's state says FP8 is off, and FP8 is on again after it. TE's modules cannot run a
    forward on a CPU, so the model has no layers and its final norm and head are recorders."""
    manager, seen = quantization.FP8GlobalStateManager, []

    class Recorder(torch.nn.Module):
        def forward(self, x):
            seen.append(manager.is_fp8_enabled())
            return x

    with cuda_device(), nb.using(te):
        model = nb.CausalLM(dataclasses.replace(cfg, n_layers=0), CPU)
        model.final_norm, model.head = torch.nn.Identity(), Recorder()
        with te.autocast(enabled=True, recipe=te_recipes.DelayedScaling()):
            model(torch.zeros(2, 8, dtype=torch.long))
            assert manager.is_fp8_enabled()
    assert seen == [False]


def test_10_1_quotes_tes_own_refusal_of_delayed_scaling_under_torch_compile():
    """Issue 47: TE's check_recipe_support raises these words for DelayedScaling while
    torch.compile traces (TE PR #2759). Not run: tracing on a CPU with a pretended GPU touches
    CUDA (Dynamo asks for the current device), so this reads TE's source, and 10.1 quotes it."""
    words = "DelayedScaling is not supported under torch.compile. Please use other recipes instead."
    source = " ".join(inspect.getsource(quantization.check_recipe_support).split())
    assert "if torch.compiler.is_compiling() and isinstance(recipe, DelayedScaling):" in source
    assert f'raise RuntimeError( "{words}" )' in source
    assert f'"{words}"' in " ".join(markdown_cell("### 10.1 ").split())
    # and a te.autocast without a recipe, section 6's nested one, builds TE's default recipe,
    # which TE asserts is never built while compiling: 10.1 says to give it a recipe there
    enter = " ".join(inspect.getsource(quantization.FP8GlobalStateManager.autocast_enter).split())
    default = " ".join(inspect.getsource(quantization.get_default_fp8_recipe).split())
    assert "fp8_recipe = get_default_fp8_recipe() if fp8_recipe is None else fp8_recipe" in enter
    assert "assert not torch.compiler.is_compiling()" in default
    assert "nested `te.autocast(enabled=False, recipe=...)` also spares traced code" in " ".join(
        markdown_cell("### 10.1 ").split()
    )


def test_a_nested_autocast_without_a_recipe_takes_the_training_recipes_place_and_6s_does_not(
    nb, cfg
):
    """Issue 57: TE files each autocast's recipe under a key made from its text (autocast_enter,
    get_unique_autocast_key), a disabled one too, taking TE's default DelayedScaling() when given
    none; DelayedScaling's text omits amax_compute_algo, and the update reads the recipe back by
    that key (reduce_and_update_fp8_tensors). So a nested te.autocast(enabled=False) replaces a
    "most_recent" recipe of history 1024 with "max"; section 6's forward, which passes the
    surrounding recipe, leaves it. The model has no layers; its head records TE's state."""
    manager, found = quantization.FP8GlobalStateManager, []
    tuned = dataclasses.replace(cfg, amax_history_len=1024, amax_compute_algo="most_recent")
    recipe = nb.delayed_scaling(tuned)  # AMAX_HISTORY_LEN=1024, AMAX_COMPUTE_ALGO="most_recent"
    key = manager.get_unique_autocast_key(recipe, None)
    assert key == manager.get_unique_autocast_key(te_recipes.DelayedScaling(), None)  # one text
    update = " ".join(inspect.getsource(manager.reduce_and_update_fp8_tensors).split())
    assert "recipe, group = qstate.autocast_arguments[autocast_key]" in update

    class Head(torch.nn.Module):  # what TE's update would read for this recipe's key, then
        def forward(self, x):
            found.append(manager.quantization_state.autocast_arguments[key][0])
            return x

    with cuda_device(), nb.using(te):
        model = nb.CausalLM(dataclasses.replace(cfg, n_layers=0), CPU)
        model.final_norm, model.head = torch.nn.Identity(), Head()
        with te.autocast(enabled=True, recipe=recipe), te.autocast(enabled=False):  # the old form
            model.head(None)
        with te.autocast(enabled=True, recipe=recipe):
            model(torch.zeros(2, 8, dtype=torch.long))  # section 6's forward
    manager.reset()
    assert [r.amax_compute_algo for r in found] == ["max", "most_recent"] and found[1] is recipe


def test_tes_fp8_is_off_inside_a_nested_disabled_autocast_and_back_on_after_it():
    """Issue 47: section 6 runs the LM head in `te.autocast(enabled=False)` inside the FP8 region:
    inside it TE's state says FP8 is off, and after it FP8 is on again, with the same recipe."""
    recipe, manager = te_recipes.DelayedScaling(), quantization.FP8GlobalStateManager
    with cuda_device(), te.autocast(enabled=True, recipe=recipe):
        with te.autocast(enabled=False):
            assert not manager.is_fp8_enabled()
        assert manager.is_fp8_enabled() and manager.get_fp8_recipe() is recipe
    assert not manager.is_fp8_enabled()


def tes_fp8_init_on_each_module(model, recipe, hidden, heads):
    """What an FP8 forward leaves in each TE module's fp8_meta, by TE's own code: each module's
    own forward runs under te.autocast(recipe) until TE's prepare_forward, which calls TE's
    init_fp8_metadata(num_gemms) with the number the forward passes (1; LayerNormMLP 2;
    DotProductAttention 3); there it stops, since the GEMMs need a GPU. The head runs in
    section 6's forward (its layers already done, its final norm an identity), so in the FP8
    state the notebook gives it. Patched beside "a CUDA device exists": no CUDA graph is being
    captured, and TE's recipe state allocates on the CPU instead of "cuda"."""

    class ReachedTheGemms(Exception):
        pass

    def prepare_forward(module, inp, num_gemms=1, *args, **kwargs):
        module.init_fp8_metadata(num_gemms=num_gemms)  # TE's, as prepare_forward calls it
        raise ReachedTheGemms

    state_init = quantization.DelayedScalingRecipeState.__init__

    def on_the_cpu(state, *args, device=None, **kwargs):
        state_init(state, *args, device=device or CPU, **kwargs)

    with (
        cuda_device(),
        mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False),
        mock.patch.object(TransformerEngineBaseModule, "prepare_forward", prepare_forward),
        mock.patch.object(quantization.DelayedScalingRecipeState, "__init__", on_the_cpu),
        te.autocast(recipe=recipe),
    ):
        for module in model.layers.modules():  # each takes hidden (B, T, D); attention q, k, v
            if isinstance(module, TransformerEngineBaseModule):
                qkv = (hidden.unflatten(-1, (heads, -1)),) * 3  # each (B, T, heads, head size)
                with contextlib.suppress(ReachedTheGemms):
                    module(*qkv) if isinstance(module, te.DotProductAttention) else module(hidden)
        layers, norm = model.layers, model.final_norm
        model.layers, model.final_norm = torch.nn.ModuleList(), torch.nn.Identity()
        with contextlib.suppress(ReachedTheGemms):
            model(torch.zeros(hidden.shape[:2], dtype=torch.long))
        model.layers, model.final_norm = layers, norm


def test_after_a_forward_outside_te_autocast_te_saves_no_fp8_state(nb, cfg):
    """Issue 58, 10.7's pitfall in TE's own code: each GEMM module's FP8 init under te.autocast
    (tes_fp8_init_on_each_module) sets fp8_meta["fp8_checkpoint"]; init_fp8_metadata outside
    it, as every forward there runs it (prepare_forward), clears it, and TE's get_extra_state
    then returns an empty tensor: no FP8 state in the checkpoint. (With the flag set,
    get_extra_state syncs the GPU: not run here.) The main suite checks the stand-in's match."""
    with cuda_device():
        model = nb.CausalLM(cfg, CPU)
    hidden = torch.zeros(2, cfg.seq_len, cfg.d_model)
    tes_fp8_init_on_each_module(model, nb.delayed_scaling(cfg), hidden, cfg.n_heads)
    gemm_types = (te.Linear, te.LayerNormLinear, te.LayerNormMLP)
    gemms = [m for m in model.layers.modules() if isinstance(m, gemm_types)]
    assert len(gemms) == 3 * cfg.n_layers and all(m.fp8_meta["fp8_checkpoint"] for m in gemms)
    with cuda_device():
        for module in gemms:
            module.init_fp8_metadata()  # TE's, as a forward outside te.autocast calls it
            assert module.fp8_meta["fp8_checkpoint"] is False
            assert module.get_extra_state().numel() == 0


def test_the_notebook_reads_each_fp8_tensor_from_the_slot_te_gives_it_and_skips_attention(nb, cfg):
    """fp8_tensors labels slot 3k (3k+1) of the forward state as GEMM k's input (weight), slot 2k
    of the backward state as its incoming gradient: TE's own enums and each module's quantizer
    roles must say the same. TE's init_fp8_metadata gives the state (tes_fp8_init_on_each_module):
    to every GEMM module, to each DotProductAttention too (num_gemms 3, never cast: TE's
    dot_product_attention.py forward, prepare_forward_ctx(..., num_gemms=3)), and not to the head,
    which section 6 runs outside FP8. fp8_tensors must yield the GEMMs' tensors and no other."""
    for k in range(3):
        assert int(getattr(tex.FP8FwdTensors, f"GEMM{k + 1}_INPUT")) == 3 * k
        assert int(getattr(tex.FP8FwdTensors, f"GEMM{k + 1}_WEIGHT")) == 3 * k + 1
        assert int(getattr(tex.FP8BwdTensors, f"GRAD_OUTPUT{k + 1}")) == 2 * k
    with cuda_device():
        model = nb.CausalLM(cfg, CPU)
    hidden = torch.zeros(2, cfg.seq_len, cfg.d_model)  # (B, T, D), the "bshd" layout
    tes_fp8_init_on_each_module(model, nb.delayed_scaling(cfg), hidden, cfg.n_heads)
    modules = dict(model.named_modules())
    attention = [m for m in modules.values() if isinstance(m, te.DotProductAttention)]
    assert len(attention) == cfg.n_layers and all(  # TE's state, on a module that never casts
        m.fp8_meta["num_gemms"] == 3 and m.fp8_meta["scaling_fwd"].scale.shape == (9,)
        for m in attention
    )
    assert "scaling_fwd" not in model.head.fp8_meta  # the head ran with TE's FP8 off
    seen = set()
    for label, state, slot, direction in nb.fp8_tensors(model):
        name, role_label = label.split("/")[0].rsplit(".", 1)[0], label.split("/")[1]
        module, forward = modules[name], direction == "forward"
        assert isinstance(module, (te.Linear, te.LayerNormLinear, te.LayerNormMLP)), label
        assert state is module.fp8_meta["scaling_fwd" if forward else "scaling_bwd"]
        role = module.get_quantizer_roles(fwd=forward, num_quantizers=len(state.scale))[slot]
        assert role.tensor_type == role_label, (label, role)
        gemm = label.split("/")[0].rsplit(".", 1)[1]
        assert role.name.endswith(f".{gemm}") if gemm != "gemm" else role.name == module.name
        seen.add(label)
    assert len(seen) == 3 * 4 * cfg.n_layers  # 3 tensors of qkv, proj, fc1, fc2 in each layer


def test_fp8_tensors_lists_the_stand_ins_gemms_where_te_is_te(nb, cfg, tmp_path):
    """On an A100, `te` is TE and section 8's FP8 run is the reference's (the stand-in's model):
    fp8_tensors must list its GEMMs too, and the script's fp8_lesson.py must know them."""
    with nb.using(nb.standin):
        model = nb.CausalLM(cfg, CPU)
        with nb.reference_autocast(recipe=nb.ReferenceRecipe(amax_history_len=16)):
            model(torch.zeros(2, 8, dtype=torch.long))
    assert len(list(nb.fp8_tensors(model))) == 3 * 4 * cfg.n_layers
    nb.write_lesson_module(tmp_path / "fp8_lesson.py", cfg)  # the twins joined after FP8_GEMMS
    lesson = (tmp_path / "fp8_lesson.py").read_text()
    assert lesson.index("FP8_GEMMS = (") < lesson.index("FP8_GEMMS += (TwinModule,)")


def test_10_7_builds_tes_attention_deterministic_and_leaves_the_setting_as_it_was(nb, cfg):
    """Issue 57: TE's DotProductAttention reads NVTE_ALLOW_NONDETERMINISTIC_ALGO when built
    (its __init__ sets `deterministic`); 10.7 builds its models inside the setting's patch, so
    TE's attention backward is deterministic there, and a model built after it is not."""
    setting = 'mock.patch.dict(os.environ, NVTE_ALLOW_NONDETERMINISTIC_ALGO="0")'  # 10.7's

    def attention(model):
        return [m for m in model.modules() if isinstance(m, te.DotProductAttention)]

    assert not torch.are_deterministic_algorithms_enabled()
    with cuda_device():
        with mock.patch.dict(os.environ, NVTE_ALLOW_NONDETERMINISTIC_ALGO="0"):  # `setting`
            inside = nb.CausalLM(cfg, CPU)
        after = nb.CausalLM(cfg, CPU)
    assert attention(inside) and all(m.deterministic for m in attention(inside))
    assert not any(m.deterministic for m in attention(after))
    (cell,) = [c for c in notebook_cells() if "def resume_experiment(" in "".join(c["source"])]
    assert f"with {setting}:" in "".join(cell["source"])  # where its models are built


def test_the_sentences_issue_57_corrected_are_what_tes_source_says(nb, cfg):
    """Section 6's padding is TE's assert_dim_for_fp8_exec (utils.py), which refuses the head's
    weight at VOCAB_SIZE=100 and takes it padded; section 8's "fp8_meta changes between
    versions" is base.py's TE 1.x conversion; 10.10's weight gradients are written in the
    activations' dtype (linear.py's wgrad out_dtype), then cast by autograd."""
    from transformer_engine.pytorch import utils
    from transformer_engine.pytorch.module import base, linear

    with cuda_device():
        heads = [nb.CausalLM(cfg, CPU, fp8_head=fp8).head.weight for fp8 in (False, True)]
    assert cfg.vocab_size % 8 and not heads[1].shape[0] % 16
    with pytest.raises(ValueError, match="divisible by 8"):
        utils.assert_dim_for_fp8_exec(heads[0])
    utils.assert_dim_for_fp8_exec(heads[1])
    assert "`assert_dim_for_fp8_exec`" in markdown_cell("## 6. The model")
    words = "TE 1.x also saved scale_inv"
    assert words in inspect.getsource(base) and words in markdown_cell("## 8. Inside FP8")
    assert "#2071" not in markdown_cell("## 8. Inside FP8")
    wgrad = " ".join(inspect.getsource(linear).split())
    out_dtype = "main_grad.dtype if bwd_args.fuse_wgrad_accumulation else bwd_args.activation_dtype"
    assert f'"out_dtype": ( {out_dtype} ),' in wgrad


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
    the notebook's rule must give the same histories and the same scales: the fallback's scripted
    division ((fp8_max / amax) / 2**margin) may round apart, so scales may differ by one ulp.
    Where they differ (an amax of 0: the kernel skips the roll), the notebook follows the
    kernel; the CPU tests pin that down."""
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


@pytest.mark.parametrize("algo, margin", [("max", 0), ("most_recent", 1)])
def test_section_8_2s_check_passes_tes_own_update_and_fails_it_applied_twice(nb, algo, margin):
    """8.2's check recomputes the rule without the notebook's update_scales. Here it watches
    TE's own state objects updated by TE's unfused Python update, called directly: every amax
    cast, it must pass; an update run twice per step (the history rolled twice) fails it."""
    recipe = te_recipes.DelayedScaling(amax_history_len=8, amax_compute_algo=algo, margin=margin)
    directions = (("scaling_fwd", "forward", 3), ("scaling_bwd", "backward", 2))
    with cuda_device():
        layer = te.Linear(16, 16, device=CPU)  # its state as TE's first FP8 forward leaves it
    layer.fp8_meta |= {"num_gemms": 1} | {
        key: quantization.DelayedScalingRecipeState(recipe, mode=mode, num_quantizers=n, device=CPU)
        for key, mode, n in directions
    }
    generator = torch.Generator().manual_seed(margin)

    def te_step(updates=1):  # this step's amaxes in row 0, then TE's update
        for key, mode, n in directions:
            state, fp8_max = (
                layer.fp8_meta[key],
                quantization.get_fp8_max(recipe, mode == "forward"),
            )
            state.amax_history[0] = torch.rand(n, generator=generator) * 100 + 0.01
            for _ in range(updates):
                quantization._amax_and_scale_update(
                    state.amax_history, state.scale, fp8_max, recipe
                )

    for _ in range(3):
        te_step()
    worst, rolled = nb.check_scale_update(layer, recipe, te_step)
    assert rolled and worst < 1e-6  # within an ulp of TE's scripted division
    assert nb.check_scale_update(layer, recipe, functools.partial(te_step, 2))[1] is False


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_te_takes_a_history_of_one_as_most_recent_and_keeps_no_amax_after_the_update(algo):
    """What AMAX_HISTORY_LEN's rule says of TE, from TE's own update: one row is accepted, its
    scale comes from this step's amax whatever the algorithm, and the update clears the row, so
    nothing is left for the notebook to read in row -1 (hence its own limit of 2)."""
    recipe = te_recipes.DelayedScaling(amax_history_len=1, amax_compute_algo=algo)
    amaxes = torch.tensor([[2.0, 0.5, 300.0]])
    history, scale = amaxes.clone(), torch.ones(3)
    quantization._amax_and_scale_update(history, scale, 448.0, recipe)
    torch.testing.assert_close(scale, 448.0 / amaxes[0], rtol=2.5e-7, atol=0)
    assert torch.equal(history, torch.zeros(1, 3))


def test_fused_adam_has_the_master_weight_calls_the_notebook_makes():
    """10.6 trains all three weight kinds with one optimizer, FusedAdam, weight decay 0.01."""
    assert {"master_weights", "weight_decay"} <= set(
        inspect.signature(te.optimizers.FusedAdam.__init__).parameters
    )
    inspect.signature(te.optimizers.FusedAdam.initialize_state).bind(
        None, None, store_param_remainders=False
    )
    inspect.signature(te.optimizers.FusedAdam.set_scaled_state).bind(
        None, None, "master_param", None
    )


def test_the_data_parallel_recipe_is_tes_own_dataclass_with_reduce_amax(nb, cfg):
    """Section 10.8 turns the reduction off with delayed_scaling(cfg, reduce_amax=False), which
    builds TE's own DelayedScaling from the notebook's fields."""
    on, off = nb.delayed_scaling(cfg), nb.delayed_scaling(cfg, reduce_amax=False)
    assert type(off) is te_recipes.DelayedScaling and on.reduce_amax and not off.reduce_amax
    assert off.amax_history_len == cfg.amax_history_len
    assert "amax_reduction_group" in inspect.signature(te.autocast).parameters


def test_the_data_parallel_script_runs_under_torchrun_beside_te(nb, cfg, tmp_path):
    """The script and fp8_lesson.py in TE's environment (torch's CUDA build, TE installed), on a
    machine with no GPU: import_te stops before importing TE, so the ranks train the stand-in on
    gloo. TE's own reduction on several GPUs is not run here (nor anywhere yet)."""
    small = dataclasses.replace(cfg, d_model=64, ffn_hidden=128, batch_size=16)
    ranks = nb.run_data_parallel(small, 2, 2, script=write_cell_file("fp8_ddp.py", tmp_path))
    assert [rank["same"] for rank in ranks] == [[[True, True]] * 2] * 2


def random_tensors(count=12):
    """Activation-like tensors over 24 orders of magnitude, each with a block of zeros."""
    g = torch.Generator().manual_seed(0)
    for k in range(count):
        x = torch.randn(128, 128, generator=g) * torch.exp(2 * torch.randn(128, 128, generator=g))
        x[:16, :16] = 0
        yield x * 10.0 ** (2 * k - 12)


def test_the_current_scaling_reference_is_tes_own_python_reference_bitwise(nb):
    """TE's CurrentScalingQuantizerRef (custom_recipes): the same scale, the same FP8 values."""
    from transformer_engine.pytorch.custom_recipes.reference_current_scaling import (
        CurrentScalingQuantizerRef,
    )

    for x in random_tensors():
        for fmt, dtype in (("E4M3", torch.float8_e4m3fn), ("E5M2", torch.float8_e5m2)):
            te_scale, _, _ = CurrentScalingQuantizerRef.compute_scale(x, dtype)
            scale, _ = nb.current(fmt)(x.abs().max().reshape(1))
            assert torch.equal(scale, te_scale)
            assert torch.equal(
                (x * scale).clamp(-nb.FP8_MAX[fmt], nb.FP8_MAX[fmt]).to(dtype),
                (x * te_scale).to(dtype),
            )


@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])  # activations and gradients; weights
def test_the_nvfp4_reference_is_tes_own_python_reference_bitwise(nb, tile):
    """TE's NVFP4QuantizerRef (custom_recipes): the same E4M3 block scales, the same E2M1 values
    (the Hadamard transform and stochastic rounding off, as in the notebook's reference)."""
    from transformer_engine.pytorch.custom_recipes import reference_utils
    from transformer_engine.pytorch.custom_recipes.reference_nvfp4 import (
        NVFP4QuantizerRef,
        cast_from_fp4x2,
    )

    rows, cols = tile
    reference = NVFP4QuantizerRef(reference_utils.Fp4Formats.E2M1, quant_tile_shape=tile)
    for x in random_tensors():
        amax = x.abs().max().reshape(1)
        codes, block_scales = reference._quantize_blockwise_reference(
            x, amax, cols, rows, pow_2_scales=False, eps=0.0
        )
        tiles = x.reshape(128 // rows, rows, 128 // cols, cols)
        scale, undo = nb.nvfp4(x.abs().max())(tiles.abs().amax(dim=(1, 3), keepdim=True))
        assert torch.equal(
            nb.round_e2m1(tiles * scale).reshape(128, 128), cast_from_fp4x2(codes, torch.float32)
        )
        ours = (undo * nb.max_over(amax, 448 * 6.0)).to(torch.float8_e4m3fn).float()
        assert torch.equal(
            ours.expand(-1, rows, -1, 1).reshape(128, 128 // cols), block_scales.float()
        )


def test_tes_quantizers_take_the_notebooks_arguments():
    """Section 10.7's check builds these on a GPU; here TE's own constructors run (NVFP4's wants
    a GPU, so its signature is bound instead)."""
    e4m3, rows = tex.DType.kFloat8E4M3, {"rowwise": True, "columnwise": False}
    with cuda_device():
        te.Float8CurrentScalingQuantizer(e4m3, CPU, **rows)
        assert te.Float8BlockQuantizer(e4m3, **rows, block_scaling_dim=1).block_scaling_dim == 1
        te.MXFP8Quantizer(e4m3, **rows)
    inspect.signature(te.NVFP4Quantizer).bind(**rows)


def test_block_scaling_wants_multiples_of_128_as_the_notebook_pads_for():
    quantizer = te.Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False)
    assert quantizer.is_quantizable(torch.empty(256, 128))
    assert not quantizer.is_quantizable(torch.empty(256, 112))  # a vocabulary padded to 16 only
    for name, multiple in (("MXFP8BlockScaling", 32), ("NVFP4BlockScaling", 128)):
        assert quantization.get_align_size_for_quantization(getattr(te_recipes, name)()) == multiple


def check_statistics_with_tes_own_checks(config_yaml):
    """Each statistic the config asks for, through TE's own checks of its debug features:
    LogFp8TensorStats raises ValueError on a name it does not support; LogTensorStats says no."""
    from transformer_engine.debug.features.log_fp8_tensor_stats import LogFp8TensorStats
    from transformer_engine.debug.features.log_tensor_stats import LogTensorStats

    for section in yaml.safe_load(config_yaml).values():
        features = section["transformer_engine"]
        for stat in features["LogFp8TensorStats"]["stats"]:  # trained with DelayedScaling
            assert LogFp8TensorStats().check_if_stat_is_supported(stat, "fp8_delayed_scaling", True)
        for stat in features["LogTensorStats"]["stats"]:
            assert LogTensorStats()._is_supported_stat(stat), f"LogTensorStats has no {stat}"


def test_tes_debug_tools_take_the_notebooks_config_and_each_of_its_statistics(nb):
    with nb.te_debug(nb.FP8_HEALTH_YAML) as (debug_api, _):
        assert debug_api.DEBUG_MANAGER is not None
    check_statistics_with_tes_own_checks(nb.FP8_HEALTH_YAML)
    assert debug_api.DEBUG_MANAGER is None  # ended: the next models are built without the tools
    with nb.te_debug(nb.OUT_OF_FP8_YAML.format("^layers[.]0[.]")) as (debug_api, _):
        assert debug_api.DEBUG_MANAGER is not None  # 10.11's DisableQuantizationLayer, taken


@pytest.mark.parametrize(
    "right, wrong, error",
    [
        ("LogFp8TensorStats:", "LogFp8TensorStat:", AssertionError),  # at initialize, TE's words
        ("underflows%,", "underflow%,", ValueError),  # TE's check of each statistic
        ("cur_amax", "curamax", AssertionError),
    ],
)
def test_a_misspelt_feature_or_statistic_fails_here(nb, right, wrong, error):
    config = nb.FP8_HEALTH_YAML.replace(right, wrong, 1)
    assert config != nb.FP8_HEALTH_YAML
    with pytest.raises(error):
        with nb.te_debug(config):
            pass
        check_statistics_with_tes_own_checks(config)


def test_the_configs_layers_are_every_fp8_gemm_of_the_model_by_the_names_te_gives_them(nb, cfg):
    """Built inside te_debug (after a model built without it, which TE would otherwise refuse),
    the model's TE modules carry the names 10.11 cites; the config's pattern picks all but the
    head (outside FP8). TE logs a LayerNormMLP's two GEMMs as <name>.fc1 and <name>.fc2."""
    with cuda_device():
        nb.CausalLM(cfg, CPU)
        with nb.te_debug(nb.FP8_HEALTH_YAML):
            model = nb.CausalLM(cfg, CPU)
    with nb.using(nb.standin):
        twin = nb.CausalLM(cfg, CPU)
    gemm_types = (te.Linear, te.LayerNormLinear, te.LayerNormMLP)
    names = [m.name for m in model.modules() if isinstance(m, gemm_types)]
    pattern = re.search(r"layer_name_regex_pattern: '(.+?)'", nb.FP8_HEALTH_YAML).group(1)
    picked = [name for name in names if re.search(pattern, name)]
    expected = ("self_attention.layernorm_linear_qkv", "self_attention.proj", "layernorm_mlp")
    assert picked == [f"layers.{i}.{m}" for i in range(cfg.n_layers) for m in expected]
    assert len(names) == len(picked) + 1 and model.head.name not in picked
    assert "`layers.0.self_attention.layernorm_linear_qkv`" in markdown_cell("### 10.11")
    twins = [path for path, m in twin.named_modules() if hasattr(m, "fp8_meta") and path != "head"]
    assert [nb.te_debug_name(path) for path in twins] == picked  # the reference logs as TE names


def test_the_notebook_reads_the_statistics_log_tes_tools_write(nb):
    """A line written by nvdlfw_inspect's own logger, as TE's stats buffer calls it."""
    from nvdlfw_inspect.logging import MetricLogger

    layer = "layers.0.self_attention.layernorm_linear_qkv"
    with nb.te_debug(nb.FP8_HEALTH_YAML) as (_, log_dir):
        MetricLogger.log_scalar(f"{layer}_activation_underflows%", torch.tensor(0.0123), 3)
        MetricLogger.log_scalar(f"{layer}_gradient_fp8_current_scaling_underflows%", 2.5, 4)
    assert nb.read_stats_log(log_dir) == {
        (layer, "activation", "underflows%"): {3: 0.0123},
        (layer, "gradient", "fp8_current_scaling_underflows%"): {4: 2.5},
    }


def test_te_debug_logs_a_gradients_scale_inv_in_full_and_nvdlfw_inspects_own_log_does_not(nb):
    """Issue 57: nvdlfw_inspect's own statistics log writes `value={:.4f}` (logging.py): a
    gradient's scale_inv_min, about 1e-8, reads 0. te_debug's logger keeps 6 digits."""
    import nvdlfw_inspect.api as debug_api
    from nvdlfw_inspect.logging import MetricLogger

    name, value = "layers.0.self_attention.proj_gradient_scale_inv_min", 2.98023e-08
    with nb.te_debug(nb.FP8_HEALTH_YAML) as (_, log_dir):
        MetricLogger.log_scalar(name, torch.tensor(value), 7)
    assert nb.read_stats_log(log_dir)[
        name.rsplit("_gradient_")[0], "gradient", "scale_inv_min"
    ] == {7: pytest.approx(value, rel=1e-5)}
    config = next(log_dir.glob("config.yaml"))
    features = [str(Path(te.__file__).parents[1] / "debug" / "features")]
    try:  # nvdlfw_inspect's own statistics logger, as without te_debug's
        debug_api.initialize(
            str(config), features, log_dir=str(log_dir / "own"), default_logging_enabled=True
        )
        MetricLogger.log_scalar(name, torch.tensor(value), 7)
    finally:
        debug_api.end_debug()
        for logger in map(logging.getLogger, ("nvdlfw_inspect", "Default Statistics")):
            while logger.handlers:
                logger.handlers.pop().close()
    assert next(iter(nb.read_stats_log(log_dir / "own").values())) == {7: 0.0}


def test_a_second_te_debug_session_logs_only_to_its_own_files(nb):
    """nvdlfw_inspect's end_debug leaves its loggers' handlers: without te_debug removing them,
    each later session wrote its statistics into every earlier log too, and each warning twice."""
    from nvdlfw_inspect.logging import MetricLogger

    with nb.te_debug(nb.FP8_HEALTH_YAML) as (_, first):
        pass
    with nb.te_debug(nb.FP8_HEALTH_YAML) as (_, second):
        MetricLogger.log_scalar("layers.0.self_attention.proj_activation_underflows%", 1.0, 1)
    assert nb.read_stats_log(first) == {} and len(nb.read_stats_log(second)) == 1
    loggers = ("nvdlfw_inspect", "Default Statistics")  # nvdlfw_inspect/logging.py's
    assert not any(logging.getLogger(name).handlers for name in loggers)


def test_tes_autocast_exit_updates_the_forward_scales_only_outermost_and_with_gradients_on():
    """Issue 59, 10.12: TE's own autocast_exit (quantization.py, ~779: `enabled and
    autocast_depth == 0 and not _graph and torch.is_grad_enabled()`) decides when the forward
    amaxes are reduced and the scales updated. The update itself runs TE's fused kernel (a GPU):
    it is replaced by a recorder, and the decision is TE's."""
    manager, recipe = quantization.FP8GlobalStateManager, te_recipes.DelayedScaling()
    with cuda_device(), mock.patch.object(manager, "reduce_and_update_fp8_tensors") as update:
        with torch.no_grad(), te.autocast(recipe=recipe):  # evaluation, generation
            pass
        with torch.enable_grad(), te.autocast(recipe=recipe):
            with te.autocast(recipe=recipe):  # an inner exit is not the outermost
                pass
            assert update.call_count == 0
    assert update.call_args_list == [mock.call(forward=True)]  # eval() is no part of it


def test_fp8_state_kept_puts_back_the_row_tes_quantizers_write_their_amaxes_into(nb, cfg):
    """Issue 59, 10.12: each DelayedScaling quantizer's amax is a view of row 0 of its module's
    amax history (make_quantizers, quantization.py ~1449), where TE's casts max-accumulate,
    with or without gradients. A cast needs a GPU, so the amax is written where its kernel
    writes it, into the quantizer's amax. fp8_state_kept puts row 0 back in place: the history
    and TE's quantizers read the row as it was."""
    with cuda_device():
        model = nb.CausalLM(cfg, CPU)
    hidden = torch.zeros(2, cfg.seq_len, cfg.d_model)
    tes_fp8_init_on_each_module(model, nb.delayed_scaling(cfg), hidden, cfg.n_heads)
    gemms = [m for m in model.layers.modules() if isinstance(m, nb.FP8_GEMMS)]
    quantizers = [q for m in gemms for q in m.quantizers["scaling_fwd"]]
    rows = [m.fp8_meta["scaling_fwd"].amax_history[0] for m in gemms]
    assert len(gemms) == 3 * cfg.n_layers and all((row == 0).all() for row in rows)
    for q in quantizers:
        q.amax.fill_(2.0)  # an earlier cast's, not yet folded in: kept as it is
    with nb.fp8_state_kept(model):
        for q in quantizers:
            q.amax.fill_(3.0)  # as a cast's kernel would
        assert all((row == 3.0).all() for row in rows)  # the history's row 0 is the same memory
        assert not torch.is_grad_enabled()
    assert all((row == 2.0).all() for row in rows) and all(q.amax.item() == 2 for q in quantizers)


def test_tes_layers_take_is_first_microbatch_as_the_notebook_passes_it():
    """Issue 59, 10.12: section 6's forward passes is_first_microbatch to each te.TransformerLayer,
    which passes it on to its GEMM modules; each keeps its weight casts when it is not None
    (linear.py: `update_ws = is_first_microbatch is None or is_first_microbatch`; the cache is
    named "weight" only then). The forwards need a GPU; their signatures and rule are read here."""
    for module in (te.TransformerLayer, te.Linear, te.LayerNormLinear, te.LayerNormMLP):
        parameter = inspect.signature(module.forward).parameters["is_first_microbatch"]
        assert parameter.default is None, module
    passes_it = "is_first_microbatch=is_first_microbatch"  # on to its attention and its MLP
    assert inspect.getsource(te.TransformerLayer.forward).count(passes_it) >= 2
    assert passes_it in inspect.getsource(te.MultiheadAttention.forward)  # on to its linears
    linear = inspect.getsource(te.module.linear)
    assert "update_ws = is_first_microbatch is None or is_first_microbatch" in linear
    assert 'cache_name = None if (is_first_microbatch is None or self.is_fsdp2) else "weight"' in (
        linear
    )


def test_tes_delayed_scaling_state_starts_at_scale_1_and_the_serving_file_loads_into_te(
    nb, cfg, tmp_path
):
    """Issue 59, 10.12: a module's DelayedScaling recipe state starts with scale = ones
    (quantization.py, DelayedScalingRecipeState.__init__), so an FP8-weight model loaded without
    `_extra_state` casts its weights at 1. The serving file (serving_state, from a checkpoint in
    10.7's format of the stand-in's FP8-trained model) holds no `_extra_state`, and a TE model
    takes it with load_weights."""
    recipe = nb.delayed_scaling(cfg)
    state = quantization.DelayedScalingRecipeState(
        recipe, mode="forward", num_quantizers=6, device=CPU
    )
    assert torch.equal(state.scale, torch.ones(6)) and not state.amax_history.any()
    with nb.using(nb.standin):
        trained = nb.CausalLM(cfg, CPU)
        with nb.reference_autocast(recipe=nb.ReferenceRecipe()):
            trained(torch.zeros(2, 8, dtype=torch.long))
    torch.save({"model": trained.state_dict()}, path := tmp_path / "checkpoint.pt")
    serving = nb.serving_state(torch.load(path)["model"])
    assert serving.keys() == {k for k in trained.state_dict() if not k.endswith("_extra_state")}
    with cuda_device():
        model = nb.load_weights(nb.CausalLM(cfg, CPU), serving)
    assert torch.equal(model.head.weight, trained.head.weight)


def test_the_inference_models_are_built_and_loaded_as_tes_source_says(nb, cfg):
    """Issue 59, 10.12 on a GPU (served_in_fp8_weights, generation_timed): built_with_weights
    (10.6's cell) runs here with TE for BF16 weights: no module of TE's holds FP8 weights and the
    head is BF16; quantized_model_init turns FP8 parameters on and, for the head, off. FP8 weights
    need a GPU to be made, so what the notebook relies on is read in TE's source: made under
    no_grad they keep no transpose (module/base.py); a load without `_extra_state` leaves the
    recipe state's scale as it is (base.py, _load_from_state_dict); a high-precision tensor
    copied into a quantized one is cast by that one's quantizer (quantized_tensor.py)."""
    (cell,) = [c for c in notebook_cells() if "def built_with_weights(" in "".join(c["source"])]
    namespace = dict(vars(nb), device=CPU)
    exec("".join(cell["source"]), namespace)  # noqa: S102 the notebook's own cell
    recipe, manager = nb.delayed_scaling(cfg), quantization.FP8GlobalStateManager
    with cuda_device(), torch.no_grad():
        built = namespace["built_with_weights"](cfg, "bf16", recipe)
        with te.quantized_model_init(True, recipe):
            assert manager.with_fp8_parameters()
            with te.quantized_model_init(enabled=False):  # where the head is built
                assert not manager.with_fp8_parameters()
    te_modules = [m for m in built.modules() if isinstance(m, TransformerEngineBaseModule)]
    assert te_modules and not any(m.primary_weights_in_fp8 for m in te_modules)
    assert (
        built.head.weight.dtype == built.layers[0].layernorm_mlp.fc1_weight.dtype == torch.bfloat16
    )
    base = inspect.getsource(TransformerEngineBaseModule)
    assert "quantizer.set_usage(rowwise=True, columnwise=torch.is_grad_enabled())" in base
    assert "if extra_state_key in state_dict:\n                self.set_extra_state(" in base
    copy = inspect.getsource(te.QuantizedTensor.__torch_dispatch__)
    assert "if isinstance(dst, QuantizedTensor):\n                dst.quantize_(src)" in copy


@pytest.mark.parametrize("capability, compared", [((9, 0), True), ((8, 9), False)])
def test_10_8_compares_block_scalings_cast_where_te_refuses_only_its_gemm_quantizers_injected(
    nb, capability, compared
):
    """Issue 60: with Colab's CUDA 12.8 torch, TE's check refuses Float8BlockScaling in its
    GEMM's words ("FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >=
    12.9"); its cast needs no GEMM, so on 9.0 10.8 compares it with the reference, and on 8.9 it
    does not. TE's quantizers need a GPU: they are injected (each returns its input), so only
    which recipes are compared is checked here; each step's success is injected too."""
    with cuda_device(capability, "12.8"):
        with mock.patch.object(nb, "one_step_alone", injected_step_passes):
            runs = nb.other_recipes_here.__wrapped__()
        assert "FP8 block scaled GEMM" in {n: w for n, _, w in runs}["Float8BlockScaling"]
        namespace = dict(vars(nb), device=CPU)
        run_cell("# @title Which recipes run here", namespace)

        def quantizer(*args, **kwargs):
            return lambda x: types.SimpleNamespace(dequantize=lambda: x)

        kinds = ("Float8CurrentScaling", "Float8Block", "MXFP8", "NVFP4")
        fake_te = types.SimpleNamespace(**{f"{kind}Quantizer": quantizer for kind in kinds})
        namespace |= {"other_recipes_here": lambda: runs, "te": fake_te}
        numbers = namespace["te_quantizers_vs_references"]()
    assert ("Float8BlockScaling" in numbers) == compared
    assert "Float8CurrentScaling" in numbers and "MXFP8BlockScaling" not in numbers


@contextlib.contextmanager
def graph_capture_undone(nb):
    """What TE's make_graphed_callables leaves behind when its capture fails at its first CUDA
    call (graph.py ~1695, no try/finally): its capture flag set (set_capture_start, ~1622) and
    the model's class __call__ wrapped in its autocast (wrap_autocast, ~1659-1684); undone here."""
    from transformer_engine.pytorch import graph

    assert "__call__" not in vars(nb.CausalLM)
    try:
        yield graph
    finally:
        vars(nb.CausalLM).get("__call__") and delattr(nb.CausalLM, "__call__")
        graph.set_capture_end()


def a_device_with_bf16():
    """torch.autocast("cuda", dtype=torch.bfloat16) asks whether the device has BF16, as a 9.0
    device does (autocast_mode.py): that answer is part of "a 9.0 device exists"."""
    return mock.patch.object(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)


def test_tes_own_argument_checks_pass_the_notebooks_graph_call_and_refuse_an_old_name_beside_it(
    nb, cfg, monkeypatch
):
    """Issue 62: 10.10's copy cell calls te.make_graphed_callables with TE 2.20.2's names
    (enabled, recipe). TE's own checks of them (graph.py ~1540-1640) pass without a deprecation
    warning: the call goes on to the capture, whose first CUDA call (~1695) fails on a CPU. The
    same call with an old name beside its new one (fp8_recipe, recipe) is refused by TE."""
    recipe, inputs = te_recipes.DelayedScaling(), torch.zeros(2, 8, dtype=torch.long)
    with cuda_device(), a_device_with_bf16(), nb.using(te):
        model = nb.CausalLM(dataclasses.replace(cfg, n_layers=1), CPU)
        with graph_capture_undone(nb) as graph, mock.patch("warnings.warn") as warned:
            with pytest.raises(RuntimeError, match="NVIDIA driver") as failed:
                nb.graphed(model, inputs, recipe, torch.bfloat16)
            assert graph.is_graph_capturing() and "__call__" in vars(nb.CausalLM)  # got that far
        assert [f.name for f in failed.traceback][-4:-2] == ["graphed", "make_graphed_callables"]
        assert not [c for c in warned.call_args_list if "deprecated" in str(c)]
        real = te.make_graphed_callables

        def with_the_old_name_too(*args, **kwargs):  # the notebook's call, plus fp8_recipe
            return real(*args, **kwargs, fp8_recipe=kwargs["recipe"])

        monkeypatch.setattr(te, "make_graphed_callables", with_the_old_name_too)
        with pytest.raises(ValueError, match="deprecated `fp8_recipe` kwarg in favor of `recipe`"):
            nb.graphed(model, inputs, recipe, torch.bfloat16)
        assert not graph.is_graph_capturing()  # refused before the capture began


def test_the_graphed_models_replay_sits_inside_te_autocast_with_its_recipe_injected(
    nb, cfg, monkeypatch
):
    """TE's capture cannot run on a CPU: make_graphed_callables is injected, and its replay
    records TE's FP8 state. TE registers the graphed modules' FP8 state for the scale update
    only if FP8 is on when the replay is called (graph.py ~1307-1341), and the update runs at
    that te.autocast's exit: section 7's train_step, as the benchmark calls it on a graphed
    model, replays it with FP8 on and the same recipe."""
    manager, recipe, replayed = quantization.FP8GlobalStateManager, te_recipes.DelayedScaling(), []

    def make_graphed_callables(module, sample_args, enabled, recipe):  # TE's, injected
        def replay(idx):
            replayed.append((manager.is_fp8_enabled(), manager.get_fp8_recipe()))
            return torch.zeros(*idx.shape, cfg.vocab_size, requires_grad=True)

        module.forward = replay
        return module

    monkeypatch.setattr(te, "make_graphed_callables", make_graphed_callables)
    batch = torch.zeros(2, 9, dtype=torch.long)
    with cuda_device(), nb.using(te):
        model = nb.CausalLM(dataclasses.replace(cfg, n_layers=1), CPU)
        with a_device_with_bf16():
            nb.graphed(model, batch[:, :-1], recipe, torch.bfloat16)
        optimizer = torch.optim.SGD(model.parameters())  # AdamW asks for the GPU's stream
        nb.train_step(model, batch, optimizer, recipe, torch.bfloat16)
    assert replayed == [(True, recipe)]
    assert not manager.is_fp8_enabled()


def test_the_benchmark_undoes_a_failed_capture_that_te_leaves_behind(nb, cfg):
    """10.10's step_ms on a CPU, with graphs: TE's real capture fails at its first CUDA call
    (graph.py ~1695) after setting its capture flag (~1622, which skips backward scale updates in
    TE's modules) and wrapping CausalLM's __call__ in an autocast with FP8 off for any model but
    the captured one (~1659-1684); TE undoes both only when the capture succeeds (~1727-1734).
    step_ms undoes them either way, so the sections after the benchmark train as they should."""
    small = dataclasses.replace(cfg, n_layers=1)
    with cuda_device(), a_device_with_bf16(), nb.using(te), graph_capture_undone(nb) as graph:
        with pytest.raises(RuntimeError, match="NVIDIA driver"):
            nb.step_ms(small, te_recipes.DelayedScaling(), CPU, graphs=True)
        assert not graph.is_graph_capturing() and "__call__" not in vars(nb.CausalLM)
