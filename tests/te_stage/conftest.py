"""The TE stage: the notebook's definitions with Transformer Engine itself imported.

TE installs and imports without a GPU, and its modules construct on a CPU once a CUDA device
is said to exist. Only that is patched: "a CUDA device of compute capability X exists". Every
result below is TE's own. Run by .ci/te_stage in a venv with TE; elsewhere these tests skip,
unless REQUIRE_TE=1 makes a missing TE an error.
"""

import contextlib
import os
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch  # before TE: TE's core library finds NCCL through torch's copy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for notebook_source

try:
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch import quantization
    from transformer_engine.pytorch.utils import is_non_tn_fp8_gemm_supported
except Exception as exc:  # not installed here, or TE's own load-time checks failed
    if os.environ.get("REQUIRE_TE") == "1":
        raise
    pytest.skip(f"Transformer Engine is not importable here ({exc})", allow_module_level=True)

CAPABILITY_NAMES = {(7, 5): "Tesla T4", (8, 0): "NVIDIA A100-SXM4-40GB", (8, 9): "NVIDIA L4"}
CAPABILITY_NAMES |= {(9, 0): "NVIDIA H100 80GB HBM3", (10, 0): "NVIDIA B200"}
CAPABILITY_NAMES |= {(12, 0): "NVIDIA RTX PRO 6000 Blackwell Server Edition"}


def clear_tes_cached_checks():
    """TE caches each availability verdict: a new capability must be checked afresh."""
    is_non_tn_fp8_gemm_supported.cache_clear()  # a functools.lru_cache
    for cache in ("_FP8_SUPPORT", "_MXFP8_SUPPORT", "_NVFP4_SUPPORT", "_FP8_BLOCK_SCALING_SUPPORT"):
        setattr(quantization, cache, None)


@contextlib.contextmanager
def cuda_device(capability=(9, 0), cuda=None):
    """Pretend that a CUDA device of this compute capability exists (and, if given, that torch was
    built with this CUDA version, as Colab's 12.8 torch is); clear TE's cached checks."""
    clear_tes_cached_checks()
    with (
        mock.patch.object(torch.version, "cuda", cuda or torch.version.cuda),
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "get_device_capability", lambda *device: capability),
        mock.patch.object(
            torch.cuda, "get_device_name", lambda *device: CAPABILITY_NAMES[capability]
        ),
        mock.patch.object(quantization, "get_device_compute_capability", lambda: capability),
    ):
        yield
    clear_tes_cached_checks()


@pytest.fixture(scope="session")
def nb():
    """The notebook's definition cells, with real TE as `te`."""
    from notebook_source import load_notebook_definitions

    with cuda_device():  # the notebook imports TE only where a CUDA GPU of 8.0+ exists
        module = load_notebook_definitions()
    assert module.TE_ERROR is None and module.te is te, module.TE_ERROR
    return module


@pytest.fixture
def cfg(nb):
    from notebook_source import notebook_parameters

    return nb.check_parameters(notebook_parameters())
