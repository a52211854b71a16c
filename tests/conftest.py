"""Shared fixtures: the notebook's definitions, its defaults, and small parameters."""

import pytest
from notebook_source import load_notebook_definitions, notebook_parameters


@pytest.fixture(scope="session")
def nb():
    return load_notebook_definitions()


@pytest.fixture(scope="session")
def defaults():
    return notebook_parameters()


@pytest.fixture(scope="session")
def cfg(nb, defaults):
    """A small, valid configuration: the notebook's defaults, scaled down (frozen: shared)."""
    small = {"VOCAB_SIZE": 50, "MAX_STRIDE": 4, "D_MODEL": 64, "FFN_HIDDEN": 128, "BATCH_SIZE": 16}
    small |= {"TRAIN_STEPS": 10, "SEED": 0, "EVAL_PROMPTS": 16, "PROMPT_LEN": 4, "GEN_TOKENS": 8}
    return nb.check_parameters(defaults | small)
