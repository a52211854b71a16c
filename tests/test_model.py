"""The model: TE's architecture, its PyTorch twin, causality, and the training loop's guards."""

import dataclasses

import pytest
import torch

CPU = torch.device("cpu")


def twin(nb, cfg):
    torch.manual_seed(0)
    return nb.build_model(cfg, "torch", CPU)


@pytest.mark.parametrize("change", [{}, {"vocab_size": 100}, {"n_layers": 3, "ffn_hidden": 96}])
def test_parameter_count_matches_the_architecture_formula(nb, cfg, change):
    cfg = dataclasses.replace(cfg, **change)
    assert nb.count_parameters(twin(nb, cfg)) == nb.expected_parameter_count(cfg)


def test_twin_uses_te_parameter_names_so_te_weights_load_into_it(nb, cfg):
    """Names as registered by te.TransformerLayer (fused QKV), te.LayerNorm and te.Linear."""
    names = set(twin(nb, dataclasses.replace(cfg, n_layers=1)).state_dict())
    assert names == {
        "tok_emb.weight",
        "pos_emb.weight",
        "layers.0.self_attention.layernorm_qkv.layer_norm_weight",
        "layers.0.self_attention.layernorm_qkv.layer_norm_bias",
        "layers.0.self_attention.layernorm_qkv.weight",
        "layers.0.self_attention.layernorm_qkv.bias",
        "layers.0.self_attention.proj.weight",
        "layers.0.self_attention.proj.bias",
        "layers.0.layernorm_mlp.layer_norm_weight",
        "layers.0.layernorm_mlp.layer_norm_bias",
        "layers.0.layernorm_mlp.fc1_weight",
        "layers.0.layernorm_mlp.fc1_bias",
        "layers.0.layernorm_mlp.fc2_weight",
        "layers.0.layernorm_mlp.fc2_bias",
        "final_norm.weight",
        "final_norm.bias",
        "head.weight",
        "head.bias",
    }


def test_weights_start_like_te_default_init(nb, cfg):
    model = twin(nb, dataclasses.replace(cfg, d_model=256, ffn_hidden=1024))
    fc1 = model.layers[0].layernorm_mlp.fc1_weight
    assert abs(fc1.std().item() - 0.023) < 0.001
    assert model.layers[0].layernorm_mlp.fc1_bias.abs().max() == 0
    assert torch.all(model.layers[0].self_attention.layernorm_qkv.layer_norm_weight == 1)


def test_logits_cover_the_real_vocabulary_only(nb, cfg):
    cfg = dataclasses.replace(cfg, vocab_size=50)
    model = twin(nb, cfg)
    assert model.head.weight.shape[0] == 64
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 50)


def test_changing_a_token_changes_no_earlier_logits(nb, cfg):
    model = twin(nb, cfg)
    tokens, _ = nb.make_stride_batch(
        4, cfg.seq_len, cfg.vocab_size, cfg.max_stride, nb.seeded_generator(0, CPU)
    )
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % cfg.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_attention_runs_along_the_sequence_not_the_batch(nb, cfg):
    """Each sequence's logits are the same whether it is batched with others or alone."""
    model = twin(nb, cfg)
    tokens, _ = nb.make_stride_batch(
        4, cfg.seq_len, cfg.vocab_size, cfg.max_stride, nb.seeded_generator(0, CPU)
    )
    with torch.no_grad():
        together, alone = model(tokens), model(tokens[1:2])
    torch.testing.assert_close(together[1:2], alone)


def test_training_lowers_the_loss(nb, cfg):
    cfg = dataclasses.replace(cfg, train_steps=60)
    result = nb.train(twin(nb, cfg), cfg, nb.Plan("torch", "fp32", ""), CPU)
    assert len(result.losses) == 60 and result.seconds > 0
    assert result.final_loss < 0.7 * result.losses[0]


def test_a_non_finite_loss_stops_training_naming_the_step(nb, cfg):
    model = twin(nb, cfg)
    with torch.no_grad():
        model.head.bias[0] = float("nan")
    with pytest.raises(FloatingPointError, match="at step 0"):
        nb.train(model, cfg, nb.Plan("torch", "fp32", ""), CPU)


def test_warmup_then_cosine_schedule(nb):
    factor = nb.warmup_cosine(100)
    assert factor(0) == pytest.approx(0.1)
    assert factor(9) == pytest.approx(1.0)
    assert factor(55) == pytest.approx(0.5, abs=0.01)
    assert factor(99) < 0.01


def test_first_nonfinite_reports_absolute_step(nb):
    losses = torch.tensor([1.0, 0.5, float("inf"), float("nan")])
    assert nb.first_nonfinite(losses, 100) == 102
    assert nb.first_nonfinite(losses[:2], 0) is None
