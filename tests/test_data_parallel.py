"""Section 10.8: the data-parallel script, written from the notebook's own cells, run under
torchrun on two CPU ranks (gloo), as the notebook's check runs it."""

import subprocess
import sys
import time

import pytest
import torch
from notebook_source import notebook_cells, source

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def reduced(nb, cfg, tmp_path_factory):
    """The script under torchrun on two CPU ranks, with TE's amax reduction: what each returned."""
    path = str(tmp_path_factory.mktemp("ddp") / "fp8_ddp.py")
    return nb.run_data_parallel(cfg, 2, 3, "--cpu", path=path)


def test_two_ranks_with_tes_reduction_hold_identical_fp8_state_and_weights_at_every_step(reduced):
    assert [run["same"] for run in reduced] == [[[True, True]] * 3] * 2
    assert reduced[0]["losses"] != reduced[1]["losses"]  # each rank trained on its own half


def test_without_the_reduction_the_ranks_scales_differ_but_ddp_keeps_the_weights_equal(
    nb, cfg, tmp_path
):
    path = str(tmp_path / "fp8_ddp.py")
    unreduced = nb.run_data_parallel(cfg, 2, 2, "--cpu", "--no-amax-reduction", path=path)
    assert [run["same"] for run in unreduced] == [[[False, True]] * 2] * 2


def test_the_first_steps_forward_state_is_one_processs_on_the_joined_batch(nb, cfg, reduced):
    torch.manual_seed(cfg.seed)
    single = nb.CausalLM(cfg, CPU)
    optimizer = torch.optim.AdamW(single.parameters(), lr=cfg.learning_rate, weight_decay=0.01)
    batch = nb.training_batch(cfg, torch.Generator().manual_seed(cfg.seed))
    nb.train_step(single, batch, optimizer, nb.delayed_scaling(cfg))  # as the script
    one = nb.fp8_state_rows(single)
    forward = list(zip(reduced[0]["first_step"], one, strict=True))
    assert all(r == o for r, o in forward if "grad" not in r["tensor"])
    ratios = [r["amax"] / o["amax"] for r, o in forward if "grad" in r["tensor"]]
    assert 1.5 < sorted(ratios)[len(ratios) // 2] < 2.5  # each rank's loss: a mean over half


def test_the_script_names_a_flag_it_does_not_know_before_it_trains(nb, cfg, tmp_path):
    with pytest.raises(RuntimeError, match=r"unknown \['--no-amax-reductions'\]"):
        nb.run_data_parallel(
            cfg, 1, 1, "--cpu", "--no-amax-reductions", path=str(tmp_path / "s.py")
        )


def test_a_command_past_its_time_limit_is_stopped_and_said_so(nb):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="stopped after 1 s, its time limit: sleep 60"):
        nb.run_with_limit(["sleep", "60"], limit_s=1)
    assert time.monotonic() - started < 30


def test_a_failing_command_is_reported_with_its_error(nb):
    with pytest.raises(RuntimeError, match="status 1:\nthis rank's problem"):
        nb.run_with_limit([sys.executable, "-c", 'import sys; sys.exit("this rank\'s problem")'])


def script_text(nb, tmp_path):
    return open(nb.write_data_parallel_script(str(tmp_path / "fp8_ddp.py"))).read()


def test_the_script_is_the_notebooks_own_cells_so_it_cannot_drift(nb, tmp_path):
    text = script_text(nb, tmp_path)
    for piece in (
        "class CausalLM(",
        "def train_step(",
        "def train_data_parallel(",
        "def update_scales(",
    ):
        (cell,) = [c for c in notebook_cells("defs") if piece in source(c)]
        assert source(cell) in text  # the whole cell, verbatim
    compile(text, "fp8_ddp.py", "exec")  # and it is Python


GLOO_THREADS_AFTER_DESTROY = """
import glob
import torch
import torch.distributed as dist
from torch import nn
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
torch.nn.parallel.DistributedDataParallel(nn.Linear(16, 16))
dist.destroy_process_group()
names = [open(task).read() for task in glob.glob("/proc/self/task/*/comm")]
print(sum("gloo" in name for name in names))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_the_scripts_imports_let_destroy_process_group_stop_gloos_threads(nb):
    """DDP imports torch.distributed.nn lazily; imported once a group exists, its functions'
    defaults (group=group.WORLD) keep the group and its gloo threads alive past
    destroy_process_group, and such a thread freeing a gather's tensors as Python exits aborts the
    rank (1 torchrun run in 8 here, before the script imported it first; none in 60 after)."""
    (cell,) = [c for c in notebook_cells("defs") if "def train_data_parallel(" in source(c)]
    imports = source(cell).split("\n\n\ndef ")[0]  # the cell's imports, which the script has too
    assert "import torch.distributed.nn" in imports
    run = subprocess.run(
        [sys.executable, "-c", imports + GLOO_THREADS_AFTER_DESTROY],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert run.stdout.split() == ["0"]
