"""Section 10.9: the notebook's fp8_ddp.py cell, with fp8_lesson.py written from the notebook's
own cells beside it, run under torchrun on two CPU ranks (gloo), as the notebook's check runs it."""

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from notebook_source import LESSON, REPO, notebook_cells, source, write_cell_file


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    return write_cell_file("fp8_ddp.py", tmp_path_factory.mktemp("ddp"))


SETTINGS = ("--amax-reduction", "--no-amax-reduction")


@pytest.fixture(scope="module")
def runs(nb, cfg, script):
    """The script under torchrun on two CPU ranks, with TE's amax reduction and without, in one
    launch as the notebook's check runs it: what each rank printed, by setting."""
    printed = nb.run_data_parallel(cfg, 2, 3, "--cpu", *SETTINGS, script=script)
    return {setting: [run for run in printed if run["run"] == setting] for setting in SETTINGS}


def test_two_ranks_with_tes_reduction_hold_identical_fp8_state_and_weights_at_every_step(runs):
    reduced = runs["--amax-reduction"]
    assert [(run["rank"], run["on"], run["same"]) for run in reduced] == [
        (0, "cpu", [[True, True]] * 3),
        (1, "cpu", [[True, True]] * 3),
    ]
    assert reduced[0]["losses"] != reduced[1]["losses"]  # each rank trained on its own half


def test_without_the_reduction_the_ranks_scales_differ_but_ddp_keeps_the_weights_equal(runs):
    assert [run["same"] for run in runs["--no-amax-reduction"]] == [[[False, True]] * 3] * 2


def test_each_setting_starts_from_the_same_weights_and_batches(runs):
    """The first step's loss comes before any scale differs: the same in both settings."""
    first = {s: [run["losses"][0] for run in by_rank] for s, by_rank in runs.items()}
    assert first["--amax-reduction"] == first["--no-amax-reduction"]


def test_with_no_setting_named_the_script_trains_once_with_tes_reduction(nb, cfg, script):
    (run,) = nb.run_data_parallel(cfg, 1, 1, "--cpu", script=script)
    assert run["run"] == "--amax-reduction" and len(run["same"]) == 1


@pytest.mark.parametrize("batch_size", [3, 1])
def test_a_batch_the_ranks_do_not_divide_is_refused_naming_batch_size(nb, cfg, script, batch_size):
    """Issue 44: .chunk(2) gave the ranks 2 and 1 rows of 3, and a batch of 1 raised IndexError
    on the second rank; the script now stops first, saying what to change."""
    small = dataclasses.replace(cfg, batch_size=batch_size)
    with pytest.raises(RuntimeError, match=f"BATCH_SIZE={batch_size} must be a multiple of the 2"):
        nb.run_data_parallel(small, 2, 1, "--cpu", script=script)


def test_the_ranks_first_loss_is_one_processs_loss_on_its_half_of_the_batch(nb, cfg, runs):
    reduced = runs["--amax-reduction"]
    torch.manual_seed(cfg.seed)
    single = nb.CausalLM(cfg, torch.device("cpu"))
    batch = nb.training_batch(cfg, torch.Generator().manual_seed(cfg.seed))
    with torch.no_grad(), nb.te.autocast(recipe=nb.delayed_scaling(cfg)):
        for rank, half in enumerate(batch.chunk(2)):
            logits = single(half[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), half[:, 1:].flatten())
            assert reduced[rank]["losses"][0] == pytest.approx(loss.item(), abs=1e-4)


def test_the_gpu_run_is_recorded_as_an_experiment_its_torchrun_injected(nb, cfg):
    """Our wrapper around the script on this runtime's GPUs (an H200 run found it returning a
    list, which the experiments' record refused); torchrun's result is injected, not run."""
    (cell,) = [c for c in notebook_cells() if "def data_parallel_on_gpus(" in source(c)]
    plan = nb.Plan("fp8", "te", "", {}, "DelayedScaling")  # section 4's, where its step ran
    namespace = dict(vars(nb), cfg=cfg, plan=plan, hw=nb.Hardware("H100", (9, 0), None))
    exec(source(cell), namespace)  # noqa: S102 the notebook's own cell
    printed = [{"rank": 0, "on": "cuda:0", "losses": [4.6, 4.5], "same": [[True, True]] * 2}]
    namespace["run_recipe"] = nb.delayed_scaling(cfg)
    namespace["run_data_parallel"] = lambda cfg, ranks, steps, *flags: flags or printed
    experiments = {}
    nb.run_experiment(experiments, "data_parallel_script", None, namespace["data_parallel_on_gpus"])
    recorded = {"status": "ran", "reason": "", "ranks": printed, "fp8": "DelayedScaling"}
    assert experiments["data_parallel_script"] == recorded


def test_the_script_names_a_flag_it_does_not_know_before_it_trains(nb, cfg, script):
    with pytest.raises(RuntimeError, match=r"unknown \['--no-amax-reductions'\]"):
        nb.run_data_parallel(cfg, 1, 1, "--cpu", "--no-amax-reductions", script=script)


def test_a_command_past_its_time_limit_is_stopped_and_said_so(nb):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="stopped after 1 s, its time limit: sleep 60"):
        nb.run_with_limit(["sleep", "60"], limit_s=1)
    assert time.monotonic() - started < 30


def test_a_failing_command_is_reported_with_its_error(nb):
    with pytest.raises(RuntimeError, match="status 1:\nthis rank's problem"):
        nb.run_with_limit([sys.executable, "-c", 'import sys; sys.exit("this rank\'s problem")'])


def test_the_shipped_fp8_lesson_is_what_a_default_run_writes_from_the_notebooks_cells(
    nb, defaults, tmp_path
):
    """Issue 58: a fresh clone had no fp8_lesson.py (only a Run all wrote it). The shipped one is
    what 10.9 writes at the defaults, so neither the script nor a reader's cells can drift."""
    nb.write_lesson_module(tmp_path / "fp8_lesson.py", nb.check_parameters(defaults))
    text = (tmp_path / "fp8_lesson.py").read_text()
    stale = "stale (run tests/save_outputs.py), or a run's with other parameters (git checkout it)"
    assert LESSON.read_text() == text, stale
    for piece in ("class CausalLM(", "def train_step(", "def same_on_every_rank(", "def using("):
        (cell,) = [c for c in notebook_cells("defs") if piece in source(c)]
        assert source(cell) in text  # the whole cell, verbatim
    compile(text, "fp8_lesson.py", "exec")  # and it is Python
    ignored = subprocess.run(["git", "check-ignore", "-q", LESSON], cwd=REPO, check=False)
    assert ignored.returncode == 1  # a clone has it


def test_the_script_passes_ruff_as_the_notebook_does(script):
    for check in (["check"], ["format", "--check"]):
        command = [sys.executable, "-m", "ruff", *check, "--no-cache", "--config", ".ruff.toml"]
        subprocess.run([*command, script], cwd=REPO, check=True)


GLOO_THREADS_AFTER_DESTROY = """
import glob
import torch
import torch.distributed as dist
from torch import nn
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
ddp = torch.nn.parallel.DistributedDataParallel(nn.Linear(16, 16))
del ddp  # as the script does: a DDP kept alive keeps the group, and its threads, alive
dist.destroy_process_group()
names = [open(task).read() for task in glob.glob("/proc/self/task/*/comm")]
print(sum("gloo" in name for name in names))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_the_scripts_imports_let_destroy_process_group_stop_gloos_threads(script):
    """DDP imports torch.distributed.nn lazily; imported once a group exists, its functions'
    defaults (group=group.WORLD) keep the group and its gloo threads alive past
    destroy_process_group, and such a thread freeing a gather's tensors as Python exits aborts the
    rank (1 torchrun run in 8 here, before the script imported it first; none in 60 after). A
    DDP still referenced does the same (4 runs in 30 with the script's `ddp` kept; 0 in 30 after
    `del ddp`)."""
    lines = Path(script).read_text().splitlines()
    imports = "\n".join(line for line in lines if line.startswith("import torch"))
    assert "import torch.distributed.nn" in imports
    run = subprocess.run(
        [sys.executable, "-c", imports + GLOO_THREADS_AFTER_DESTROY],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert run.stdout.split() == ["0"]
