"""The install cell: TE only where it can work, sized to the machine, stoppable as a whole."""

import importlib.metadata
import stat
import subprocess
import time

import pytest


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
    "cores, memory_gib, jobs", [(2, 12.7, 2), (12, 83, 12), (8, 5, 3), (4, 1, 1)]
)
def test_compile_jobs_fit_the_cores_and_the_memory(nb, cores, memory_gib, jobs):
    _, why, planned = nb.te_install_plan((9, 0), None, (9, 19), cores, memory_gib)
    assert planned == jobs
    assert (
        f"{jobs} jobs ({cores} cores" in why and f"{nb.COMPILE_CPU_MINUTES / jobs:.0f} min" in why
    )


def fake_python(tmp_path, body):
    """An executable that stands in for `python -m pip ...`, so that install_te runs it."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_install_runs_ninja_then_te_with_the_cudnn_headers_first(nb, tmp_path, monkeypatch):
    log = tmp_path / "env.log"
    body = f'echo "$@" >> {log}; echo "$CPLUS_INCLUDE_PATH $MAX_JOBS" >> {log}'
    monkeypatch.setattr(nb.sys, "executable", fake_python(tmp_path, body))
    monkeypatch.setenv("CPLUS_INCLUDE_PATH", "/elsewhere")
    status, _ = nb.install_te(3, "/pip/nvidia/cudnn", log_path=str(tmp_path / "pip.log"))
    first, env, second, _ = log.read_text().splitlines()
    assert status == 0
    assert first == f"-m pip install torch=={importlib.metadata.version('torch')} ninja wheel"
    assert second.endswith("--no-build-isolation transformer_engine[pytorch]==2.20.2")
    assert env == "/pip/nvidia/cudnn/include:/elsewhere 3"  # CPLUS_INCLUDE_PATH, MAX_JOBS


def test_torch_is_pinned_to_its_installed_version_not_its_build_label(nb, tmp_path, monkeypatch):
    """PyPI's torch 2.10.0 says torch.__version__ == "2.10.0+cu128", a version pip cannot find."""
    log = tmp_path / "args.log"
    monkeypatch.setattr(nb.sys, "executable", fake_python(tmp_path, f'echo "$@" >> {log}'))
    monkeypatch.setattr(nb.torch, "__version__", "2.10.0+cu128")
    nb.install_te(1, None, log_path=str(tmp_path / "pip.log"))
    assert f"torch=={importlib.metadata.version('torch')} " in log.read_text().splitlines()[0]


def test_a_failed_pip_stops_the_install_and_returns_its_last_lines(nb, tmp_path, monkeypatch):
    monkeypatch.setattr(nb.sys, "executable", fake_python(tmp_path, "echo 'no ninja here'; exit 3"))
    status, tail = nb.install_te(2, None, log_path=str(tmp_path / "pip.log"))
    assert status == 3 and tail == ["no ninja here"]


def test_a_timeout_kills_pip_and_every_process_it_started(nb, tmp_path, monkeypatch):
    pids = tmp_path / "child.pid"
    body = f"sleep 60 & echo $! > {pids}; sleep 60"  # a "compiler" in the background, then wait
    monkeypatch.setattr(nb.sys, "executable", fake_python(tmp_path, body))
    monkeypatch.setattr(nb, "COMPILE_CPU_MINUTES", 1 / 60)  # timeout: 4x the estimate = 4 s
    started = time.monotonic()
    status, _ = nb.install_te(1, None, log_path=str(tmp_path / "pip.log"))
    assert status is None and time.monotonic() - started < 30
    child = int(pids.read_text())
    time.sleep(0.5)
    state = subprocess.run(
        ["ps", "-o", "stat=", "-p", str(child)], capture_output=True, text=True, check=False
    )
    assert state.stdout.strip() in ("", "Z"), "the background child outlived the timeout"
