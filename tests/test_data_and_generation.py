"""The data, the stride scorer and greedy generation (with and without FP8-style padding)."""

import math

import torch


def gen(nb, seed=0):
    return nb.seeded_generator(seed, torch.device("cpu"))


def test_batches_are_arithmetic_progressions_mod_vocab(nb):
    tokens, strides = nb.make_stride_batch(512, 40, 23, 5, gen(nb))
    assert tokens.shape == (512, 40) and strides.shape == (512,)
    assert tokens.min() >= 0 and tokens.max() < 23
    assert set(strides.tolist()) == {1, 2, 3, 4, 5}
    steps = (tokens[:, 1:] - tokens[:, :-1]) % 23
    assert torch.equal(steps, strides[:, None].expand_as(steps))


def test_batches_are_reproducible_from_the_seed(nb):
    a, _ = nb.make_stride_batch(8, 10, 50, 4, gen(nb, 7))
    b, _ = nb.make_stride_batch(8, 10, 50, 4, gen(nb, 7))
    c, _ = nb.make_stride_batch(8, 10, 50, 4, gen(nb, 8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_irreducible_loss_is_the_first_positions_uncertainty(nb, cfg):
    assert nb.irreducible_loss(cfg) == math.log(cfg.max_stride) / cfg.seq_len


def score(nb, prompts, continuations, vocab=10):
    return nb.score_stride_continuations(torch.tensor(prompts), torch.tensor(continuations), vocab)


def test_scorer_accepts_the_prompts_own_progression_with_wraparound(nb):
    result = score(nb, [[6, 8], [1, 2]], [[0, 2, 4], [3, 4, 5]])
    assert result == {"token_accuracy": 1.0, "sequence_accuracy": 1.0}


def test_scorer_rejects_a_constant_step_that_is_not_the_prompts(nb):
    result = score(nb, [[1, 3]], [[4, 5, 6]])  # constant step 1, prompt's stride is 2
    assert result == {"token_accuracy": 0.0, "sequence_accuracy": 0.0}


def test_scorer_counts_tokens_and_whole_sequences(nb):
    result = score(nb, [[0, 1], [0, 1]], [[2, 3, 4, 5], [2, 3, 9, 5]])
    assert result == {"token_accuracy": 7 / 8, "sequence_accuracy": 0.5}


class StrideOracle(torch.nn.Module):
    """Predicts 2*x[t] - x[t-1] (mod vocab): a perfect, causal model of the task."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, idx):
        previous = torch.cat([idx[:, :1], idx[:, :-1]], dim=1)
        return torch.nn.functional.one_hot((2 * idx - previous) % self.vocab, self.vocab).float()


def test_greedy_generation_with_a_perfect_model_scores_one(nb):
    prompts, _ = nb.make_stride_batch(32, 5, 37, 6, gen(nb))
    new = nb.generate_greedy(StrideOracle(37), prompts, 9, nb.contextlib.nullcontext)
    assert new.shape == (32, 9)
    assert nb.score_stride_continuations(prompts, new, 37)["sequence_accuracy"] == 1.0


def test_padding_the_context_to_16_does_not_change_generation(nb, cfg):
    torch.manual_seed(0)
    model = nb.build_model(cfg, "torch", torch.device("cpu"))
    prompts, _ = nb.make_stride_batch(8, cfg.prompt_len, cfg.vocab_size, cfg.max_stride, gen(nb))
    plain = nb.generate_greedy(model, prompts, cfg.gen_tokens, nb.contextlib.nullcontext, 1)
    padded = nb.generate_greedy(model, prompts, cfg.gen_tokens, nb.contextlib.nullcontext, 16)
    assert torch.equal(plain, padded)


def test_decoding_pads_only_under_fp8(nb):
    assert nb.decode_padding(nb.Plan("te", "fp8", "")) == 16
    assert nb.decode_padding(nb.Plan("te", "bf16", "")) == 1
