"""The setup cell's decisions: install TE only where it can work, visibly and with a time limit."""

import sys

import pytest


@pytest.mark.parametrize(
    "encoded, decoded", [(91200, (9, 12, 0)), (90501, (9, 5, 1)), (8902, (8, 9, 2))]
)
def test_cudnn_versions_decode_like_te(nb, encoded, decoded):
    assert nb.decode_cudnn_version(encoded) == decoded


@pytest.mark.parametrize(
    "capability, installed, cudnn, install, words",
    [
        (None, False, None, False, "No CUDA GPU"),
        ((7, 5), False, (9, 12, 0), False, "compute capability 7.5"),
        ((8, 0), False, (9, 10, 2), False, "older than the 9.12.0"),
        ((9, 0), True, (9, 12, 0), False, "already installed"),
        ((8, 9), False, (9, 12, 0), True, "Installing transformer_engine[pytorch]==2.20.2"),
    ],
)
def test_install_decision(nb, capability, installed, cudnn, install, words):
    should, why = nb.te_install_decision(capability=capability, te_installed=installed, cudnn=cudnn)
    assert should is install and words in why


def test_run_with_progress_echoes_output_and_returns_status(nb, capsys):
    status, tail = nb.run_with_progress(
        [sys.executable, "-c", "print('one'); print('two'); raise SystemExit(3)"], timeout_s=30
    )
    assert status == 3 and tail == ["one", "two"]
    assert "one\ntwo\n" in capsys.readouterr().out


def test_run_with_progress_kills_at_the_time_limit_with_heartbeats(nb, capsys):
    status, _ = nb.run_with_progress(
        [sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=2, heartbeat_s=0.5
    )
    assert status is None
    assert "still running" in capsys.readouterr().out
