"""Parameter validation: every rule fails fast, naming the parameter, its value and the rule."""

import re

import pytest


@pytest.mark.parametrize(
    "change, message",
    [
        ({"PRECISION": "fp4"}, "PRECISION='fp4': must be one of auto, fp8, bf16, fp16, fp32"),
        ({"D_MODEL": 60, "N_HEADS": 8}, "D_MODEL=60: must be divisible by N_HEADS=8"),
        ({"N_HEADS": 3}, "D_MODEL=128: must be divisible by N_HEADS=3"),
        ({"FP8_FORMAT": "E5M2"}, "FP8_FORMAT='E5M2': must be HYBRID or E4M3"),
        ({"AMAX_COMPUTE_ALGO": "mean"}, "AMAX_COMPUTE_ALGO='mean': must be max or most_recent"),
        ({"AMAX_HISTORY_LEN": 1}, "AMAX_HISTORY_LEN=1: must be an integer >= 2"),
        ({"FP8_MARGIN": -1}, "FP8_MARGIN=-1: must be an integer >= 0"),
        ({"PROMPT_LEN": 1}, "PROMPT_LEN=1: must be an integer >= 2"),
        (
            {"PROMPT_LEN": 20, "GEN_TOKENS": 13},
            "GEN_TOKENS=13: must be at most SEQ_LEN - PROMPT_LEN = 12",
        ),
        ({"MAX_STRIDE": 100}, "MAX_STRIDE=100: must be smaller than VOCAB_SIZE=100"),
        ({"LEARNING_RATE": 0.0}, "LEARNING_RATE=0.0: must be a number > 0"),
        ({"LEARNING_RATE": float("nan")}, "LEARNING_RATE=nan: must be a number > 0"),
        ({"BATCH_SIZE": 0}, "BATCH_SIZE=0: must be a positive integer"),
        ({"TRAIN_STEPS": True}, "TRAIN_STEPS=True: must be a positive integer"),
        ({"D_MODEL": 64.0}, "D_MODEL=64.0: must be a positive integer"),
        ({"SEED": -1}, "SEED=-1: must be an integer >= 0"),
        ({"RESULTS_JSON": 3}, "RESULTS_JSON=3: must be None or a file path"),
        (
            {"RESULTS_JSON": "/no/such/folder/results.json"},
            "RESULTS_JSON='/no/such/folder/results.json': must be None or a file path in an",
        ),
        ({"TE_WHEEL_DIR": __file__ + "/te"}, "TE_WHEEL_DIR="),  # inside a file: not a folder
        ({"TE_WHEEL_DIR": 7}, "TE_WHEEL_DIR=7: must be None or a folder this notebook may write"),
    ],
)
def test_each_rule_names_parameter_value_and_rule(nb, defaults, change, message):
    with pytest.raises(ValueError) as err:
        nb.check_parameters(defaults | change)
    assert message in str(err.value)


def test_all_problems_are_reported_together(nb, defaults):
    with pytest.raises(ValueError) as err:
        nb.check_parameters(
            defaults | {"FP8_FORMAT": "E5M2", "AMAX_COMPUTE_ALGO": "x", "SEED": "1"}
        )
    assert str(err.value).count("\n  ") == 3


def test_a_relation_between_sane_sizes_is_named_beside_the_other_broken_rules(nb, defaults):
    """Issue 44: with these three broken, N_HEADS's rule was left out, and the user ran again."""
    with pytest.raises(ValueError) as err:
        nb.check_parameters(defaults | {"N_HEADS": 3, "LEARNING_RATE": -1, "FP8_FORMAT": "E5M2"})
    problems = str(err.value).split("\n  ")[1:]
    assert len(problems) == 3 and "D_MODEL=128: must be divisible by N_HEADS=3" in problems
    broken_sizes = {"N_HEADS": 0, "MAX_STRIDE": 100, "PROMPT_LEN": 20, "GEN_TOKENS": 13}
    with pytest.raises(ValueError) as err:  # a relation whose size is itself broken stays out
        nb.check_parameters(defaults | broken_sizes | {"SEED": -1})
    problems = str(err.value).split("\n  ")[1:]
    assert [p.split("=")[0] for p in problems] == ["SEED", "N_HEADS", "MAX_STRIDE", "GEN_TOKENS"]


def test_the_defaults_are_valid_and_become_lower_case_fields(nb, defaults):
    cfg = nb.check_parameters(defaults)
    assert (cfg.d_model, cfg.train_steps, cfg.precision) == (128, defaults["TRAIN_STEPS"], "auto")


def test_a_wheel_folder_that_does_not_exist_yet_is_fine_where_it_can_be_made(
    nb, defaults, tmp_path
):
    cfg = nb.check_parameters(defaults | {"TE_WHEEL_DIR": str(tmp_path / "drive" / "te_wheels")})
    assert cfg.te_wheel_dir.endswith("te_wheels")
    results = nb.check_parameters(defaults | {"RESULTS_JSON": str(tmp_path / "results.json")})
    assert results.results_json.endswith("results.json")


def test_a_wheel_folder_on_google_drive_is_refused_until_drive_is_mounted(
    nb, defaults, monkeypatch
):
    """Without the mount, /content/drive/... walks up to /content, which a Colab process may
    write: the check must not let that pass, and says the two lines that mount Drive."""
    drive_folder = {"TE_WHEEL_DIR": "/content/drive/MyDrive/te_wheels"}
    monkeypatch.setattr(nb.os, "access", lambda path, mode: True)  # as on Colab: /content writable
    monkeypatch.setattr(nb.os.path, "isdir", lambda path: True)
    monkeypatch.setattr(nb.os.path, "exists", lambda path: path in ("/content", "/"))
    monkeypatch.setattr(nb.os.path, "ismount", lambda path: False)
    with pytest.raises(ValueError) as err:
        nb.check_parameters(defaults | drive_folder)
    assert "from google.colab import drive" in str(err.value)
    assert 'drive.mount("/content/drive")' in str(err.value)
    monkeypatch.setattr(nb.os.path, "ismount", lambda path: path == "/content/drive")
    assert nb.check_parameters(defaults | drive_folder).te_wheel_dir == drive_folder["TE_WHEEL_DIR"]


@pytest.mark.parametrize("version", ["2.5.1", "2.7.1+cu126", "2.6.0"])
def test_a_torch_older_than_2_8_is_refused_at_the_parameters_cell(nb, version):
    with pytest.raises(
        RuntimeError, match=rf"torch {re.escape(version)}: this notebook needs torch 2.8\+"
    ):
        nb.check_torch(version)


@pytest.mark.parametrize("version", ["2.8.0", "2.11.0+cu128", "2.13.0+cpu", "2.10.0a0+git1234"])
def test_torch_2_8_and_newer_pass(nb, version):
    nb.check_torch(version)
