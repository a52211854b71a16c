"""The install cells: TE only where it can work, sized to the machine, stoppable as a whole,
showing its progress, and kept as a wheel for later sessions when asked."""

import importlib.metadata
import stat
import subprocess
import time
from pathlib import Path

import pytest

CAPTURED_BUILD_LOG = Path(__file__).parent / "colab_like" / "te_extension_build.log"


@pytest.mark.parametrize(
    "capability, te_version, cudnn, install, words",
    [
        (None, None, (0, 0), False, "needs a CUDA GPU of compute capability 8.0+"),
        ((7, 5), None, (9, 19), False, "needs a CUDA GPU of compute capability 8.0+"),
        ((9, 0), (2, 20), (9, 19), False, "Transformer Engine is installed"),
        ((8, 0), None, (9, 10), False, "it needs cuDNN 9.12+; torch's is (9, 10)"),
        ((8, 9), None, (9, 19), True, "Installing transformer_engine[pytorch]==2.20.2"),
        ((8, 9), (2, 5), (9, 19), True, "Installing"),  # older than 2.9: no te.autocast
    ],
)
def test_install_decision(nb, capability, te_version, cudnn, install, words):
    should, why, _ = nb.te_install_plan(capability, te_version, cudnn, cores=2, memory_gib=12.7)
    assert should is install and words in why


@pytest.mark.parametrize(
    "cores, memory_gib, jobs", [(2, 12.7, 2), (12, 83, 12), (8, 5, 3), (4, 1, 1), (None, 12.7, 1)]
)
def test_compile_jobs_fit_the_cores_and_the_memory(nb, cores, memory_gib, jobs):
    _, why, planned = nb.te_install_plan((9, 0), None, (9, 19), cores, memory_gib)
    assert planned == jobs  # os.cpu_count() may be None (issue 44: a TypeError): 1 job
    assert (
        f"{jobs} jobs ({cores or '?'} cores" in why
        and f"{nb.COMPILE_CPU_MINUTES / jobs:.0f} min" in why
    )


@pytest.mark.parametrize(
    "cores, memory_gib, jobs, limit_min",
    [(2, 12.7, 2, 52.8), (12, 83, 12, 15), (26, 170, 26, 15), (48, 340, 48, 15), (48, 24, 16, 15)],
)
def test_the_compile_limit_is_four_times_its_estimate_but_never_below_a_floor(
    nb, cores, memory_gib, jobs, limit_min
):
    """A build's wall time does not shrink with the cores: its largest file compiles on one core
    whatever the job count. So 4x the estimate (52.8 min on Colab's 2 cores), and 15 min at
    least on 12, 26 or 48 cores (or 16 jobs, where 24 GiB allow no more)."""
    _, why, planned = nb.te_install_plan((9, 0), None, (9, 19), cores, memory_gib)
    assert planned == jobs and nb.compile_limit_s(jobs) == pytest.approx(limit_min * 60)
    assert f"stopped if it runs past {limit_min:.0f} min" in why


def fake_python(tmp_path, body):
    """An executable that stands in for `python -m pip ...`, so that install_te runs it."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def pip_calls(log):
    return [line.removeprefix("-m pip ") for line in log.read_text().splitlines()]


def test_a_fresh_install_compiles_the_extension_into_the_folder_then_installs_from_it(
    nb, tmp_path, monkeypatch
):
    log = tmp_path / "calls.log"
    body = f'echo "$@" >> {log}; echo "$CPLUS_INCLUDE_PATH $MAX_JOBS" >> {tmp_path / "env.log"}'
    monkeypatch.setattr(nb.sys, "executable", fake_python(tmp_path, body))
    monkeypatch.setenv("CPLUS_INCLUDE_PATH", "/elsewhere")
    folder, torch = tmp_path / "kept", f"torch=={importlib.metadata.version('torch')}"
    problem, _ = nb.install_te(3, "/pip/nvidia/cudnn", str(folder), str(tmp_path / "pip.log"))
    assert problem is None
    assert pip_calls(log) == [
        f"install {torch} ninja wheel",
        f"wheel -v --no-deps --no-build-isolation -w {folder} transformer_engine_torch==2.20.2",
        (
            f"install {torch} --no-build-isolation --find-links {folder} "
            "--only-binary transformer_engine_torch transformer_engine[pytorch]==2.20.2"
        ),
    ]
    # pip's cuDNN headers before the system's, and MAX_JOBS, for every call
    assert set((tmp_path / "env.log").read_text().splitlines()) == {
        "/pip/nvidia/cudnn/include:/elsewhere 3"
    }


def test_a_kept_wheel_is_installed_without_compiling(nb, tmp_path, monkeypatch):
    log, folder = tmp_path / "calls.log", tmp_path / "kept"
    folder.mkdir()
    (folder / "transformer_engine_torch-2.20.2-cp313-cp313-linux_x86_64.whl").touch()
    monkeypatch.setattr(nb.sys, "executable", fake_python(tmp_path, f'echo "$@" >> {log}'))
    problem, _ = nb.install_te(2, None, str(folder), str(tmp_path / "pip.log"))
    assert problem is None and len(pip_calls(log)) == 1
    assert pip_calls(log)[0].startswith("install torch==") and "--find-links" in pip_calls(log)[0]


def test_the_torch_pin_is_its_installed_version_not_its_build_label(nb, tmp_path, monkeypatch):
    """PyPI's torch 2.10.0 says torch.__version__ == "2.10.0+cu128", a version pip cannot find."""
    log = tmp_path / "args.log"
    monkeypatch.setattr(nb.sys, "executable", fake_python(tmp_path, f'echo "$@" >> {log}'))
    monkeypatch.setattr(nb.torch, "__version__", "2.10.0+cu128")
    nb.install_te(1, None, str(tmp_path / "kept"), log_path=str(tmp_path / "pip.log"))
    assert f"torch=={importlib.metadata.version('torch')} " in log.read_text().splitlines()[0]


def test_a_failed_pip_stops_the_install_and_returns_its_last_lines(nb, tmp_path, monkeypatch):
    monkeypatch.setattr(nb.sys, "executable", fake_python(tmp_path, "echo 'no ninja here'; exit 3"))
    problem, tail = nb.install_te(2, None, str(tmp_path / "kept"), str(tmp_path / "pip.log"))
    assert problem == "pip install exited with status 3" and tail == ["no ninja here"]


def test_each_pip_call_gets_the_limit_that_fits_what_it_does(nb, tmp_path, monkeypatch):
    """Downloads (ninja, TE's core library) their own limit; the compile the limit of its jobs."""
    limits = []
    monkeypatch.setattr(
        nb, "run_pip", lambda args, env, log, limit_s, bar=None: limits.append((args[0], limit_s))
    )
    nb.install_te(12, None, str(tmp_path / "kept"), str(tmp_path / "pip.log"))
    assert limits == [
        ("install", nb.DOWNLOAD_LIMIT_S),
        ("wheel", nb.compile_limit_s(12)),
        ("install", nb.DOWNLOAD_LIMIT_S),
    ]


def test_a_limit_stops_pip_and_every_process_it_started_and_says_so(nb, tmp_path, monkeypatch):
    pids = tmp_path / "child.pid"
    body = f"sleep 60 & echo $! > {pids}; sleep 60"  # a "compiler" in the background, then wait
    monkeypatch.setattr(nb.sys, "executable", fake_python(tmp_path, body))
    started = time.monotonic()
    with open(tmp_path / "pip.log", "w") as log:
        problem = nb.run_pip(["wheel"], None, log, 2)
    assert problem == "pip wheel stopped after 2 s, its time limit"
    assert time.monotonic() - started < 30
    child = int(pids.read_text())
    time.sleep(0.5)
    state = subprocess.run(
        ["ps", "-o", "stat=", "-p", str(child)], capture_output=True, text=True, check=False
    )
    assert state.stdout.strip() in ("", "Z"), "the background child outlived the limit"


class Bar:
    """What run_pip asks of a progress bar (tqdm's total, n and refresh), recording each state."""

    def __init__(self):
        self.total, self.n, self.seen = None, 0, []

    def refresh(self):
        self.seen.append((self.n, self.total))


def test_the_progress_bar_follows_the_compile_in_a_real_build_log(nb, tmp_path, monkeypatch):
    """pip's output from a real `pip wheel -v` of TE's extension, captured in the Colab-like run
    (tests/colab_like/, phase kept-build; lines cut at 400 characters): each file that ninja
    finishes moves the bar, up to all of them."""
    monkeypatch.setattr(nb.sys, "executable", fake_python(tmp_path, f"cat {CAPTURED_BUILD_LOG}"))
    bar = Bar()
    with open(tmp_path / "pip.log", "w") as log:
        assert nb.run_pip(["wheel"], None, log, 60, bar) is None
    assert (tmp_path / "pip.log").read_text() == CAPTURED_BUILD_LOG.read_text()
    assert bar.seen[-1] == (nb.EXTENSION_FILES, nb.EXTENSION_FILES)
    assert len(set(bar.seen)) >= 10


def test_kept_wheels_are_found_only_for_this_python_torch_and_cuda(nb, tmp_path):
    here = nb.wheel_folder(str(tmp_path), "3.13", "2.11.0+cu128", "12.8")
    assert Path(here).name == "te2.20.2-py3.13-torch2.11.0+cu128-cuda12.8"
    assert nb.kept_wheel(here) == (None, "nothing is kept there yet")
    other = Path(nb.wheel_folder(str(tmp_path), "3.12", "2.10.0", "12.8"))
    other.mkdir()
    (other / "transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl").touch()
    found, why = nb.kept_wheel(here)
    assert found is None and "te2.20.2-py3.12-torch2.10.0-cuda12.8" in why
    Path(here).mkdir()
    (Path(here) / "transformer_engine_torch-2.20.2-cp313-cp313-linux_x86_64.whl").touch()
    assert nb.kept_wheel(here) == (here, "")
