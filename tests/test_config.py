"""Parameter validation: every rule fails fast, naming the parameter, its value and the rule."""

import dataclasses

import pytest


@pytest.mark.parametrize(
    "change, message",
    [
        ({"precision": "fp4"}, "PRECISION='fp4': must be one of"),
        ({"d_model": 60, "n_heads": 8}, "D_MODEL=60: must be divisible by N_HEADS=8"),
        ({"fp8_format": "E5M2"}, "FP8_FORMAT='E5M2': must be one of ('HYBRID', 'E4M3')"),
        ({"amax_compute_algo": "mean"}, "AMAX_COMPUTE_ALGO='mean': must be one of"),
        ({"amax_history_len": 1}, "AMAX_HISTORY_LEN=1: must be at least 2"),
        ({"fp8_margin": -1}, "FP8_MARGIN=-1: must be a non-negative integer"),
        ({"prompt_len": 1}, "PROMPT_LEN=1: must be at least 2"),
        (
            {"prompt_len": 20, "gen_tokens": 13},
            "GEN_TOKENS=13: PROMPT_LEN + GEN_TOKENS must be <= SEQ_LEN=32",
        ),
        ({"max_stride": 50}, "MAX_STRIDE=50: must be smaller than VOCAB_SIZE"),
        ({"learning_rate": 0.0}, "LEARNING_RATE=0.0: must be a positive finite number"),
        ({"batch_size": 0}, "BATCH_SIZE=0: must be a positive integer"),
        ({"train_steps": -5}, "TRAIN_STEPS=-5: must be a positive integer"),
        ({"d_model": 64.0}, "D_MODEL=64.0: must be a positive integer"),
        ({"vocab_size": 0}, "VOCAB_SIZE=0: must be a positive integer"),
    ],
)
def test_each_rule_names_parameter_value_and_rule(cfg, change, message):
    with pytest.raises(ValueError) as err:
        dataclasses.replace(cfg, **change)
    assert message in str(err.value)


def test_all_problems_are_reported_together(cfg):
    with pytest.raises(ValueError) as err:
        dataclasses.replace(cfg, fp8_format="E5M2", amax_compute_algo="mean", prompt_len=1)
    text = str(err.value)
    assert "FP8_FORMAT" in text and "AMAX_COMPUTE_ALGO" in text and "PROMPT_LEN" in text


def test_defaults_in_the_notebook_are_valid(nb):
    from conftest import notebook_cells

    params = {}
    exec("".join(notebook_cells("parameters")[0]["source"]), params)
    fields = {f.name for f in dataclasses.fields(nb.RunConfig)}
    nb.RunConfig(
        **{name.lower(): value for name, value in params.items() if name.lower() in fields}
    )


def plan(nb, precision):
    return nb.Plan("te", precision, "test")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"d_model": 72, "n_heads": 4}, "D_MODEL=72: must be a multiple of 16"),
        ({"ffn_hidden": 100}, "FFN_HIDDEN=100: must be a multiple of 16"),
        ({"seq_len": 24, "batch_size": 3}, "SEQ_LEN=24: must be a multiple of 16"),
    ],
)
def test_fp8_shape_rules_apply_only_to_fp8_plans(nb, cfg, change, message):
    changed = dataclasses.replace(cfg, **change)
    nb.validate_for_plan(changed, plan(nb, "bf16"))
    with pytest.raises(ValueError, match="for the fp8 plan") as err:
        nb.validate_for_plan(changed, plan(nb, "fp8"))
    assert message in str(err.value)


def test_token_count_is_in_the_seq_len_message(nb, cfg):
    with pytest.raises(ValueError, match=r"BATCH_SIZE\*SEQ_LEN=72 tokens"):
        nb.validate_for_plan(dataclasses.replace(cfg, seq_len=24, batch_size=3), plan(nb, "fp8"))


@pytest.mark.parametrize("vocab, padded", [(100, 112), (96, 96), (1, 16), (17, 32)])
def test_vocabulary_is_padded_to_a_multiple_of_16(nb, vocab, padded):
    assert nb.padded_vocab_size(vocab) == padded
