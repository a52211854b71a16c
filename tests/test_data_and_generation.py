"""The data, the stride scorer and greedy generation (with and without FP8's padding rows)."""

import torch

CPU = torch.device("cpu")


def gen(seed=0):
    return torch.Generator(CPU).manual_seed(seed)


def test_batches_are_arithmetic_progressions_mod_vocab(nb):
    tokens, strides = nb.make_stride_batch(512, 40, 23, 5, gen())
    assert tokens.shape == (512, 40) and strides.shape == (512,)
    assert tokens.min() >= 0 and tokens.max() < 23
    assert set(strides.tolist()) == {1, 2, 3, 4, 5}
    steps = (tokens[:, 1:] - tokens[:, :-1]) % 23
    assert torch.equal(steps, strides[:, None].expand_as(steps))


def test_batches_are_reproducible_from_the_seed(nb):
    a, _ = nb.make_stride_batch(8, 10, 50, 4, gen(7))
    b, _ = nb.make_stride_batch(8, 10, 50, 4, gen(7))
    c, _ = nb.make_stride_batch(8, 10, 50, 4, gen(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_training_batch_holds_inputs_and_their_next_tokens(nb, cfg):
    assert nb.training_batch(cfg, gen()).shape == (cfg.batch_size, cfg.seq_len + 1)


def score(nb, prompts, continuations, vocab=10):
    return nb.stride_scores(torch.tensor(prompts), torch.tensor(continuations), vocab)


def test_the_scorer_accepts_the_prompts_own_progression_with_wraparound(nb):
    assert score(nb, [[6, 8], [1, 2]], [[0, 2, 4], [3, 4, 5]]) == {
        "token_accuracy": 1.0,
        "sequence_accuracy": 1.0,
    }


def test_the_scorer_rejects_a_constant_step_that_is_not_the_prompts(nb):
    result = score(nb, [[1, 3]], [[4, 5, 6]])  # a constant step of 1; the prompt's stride is 2
    assert result == {"token_accuracy": 0.0, "sequence_accuracy": 0.0}


def test_the_scorer_counts_tokens_and_whole_sequences(nb):
    result = score(nb, [[0, 1], [0, 1]], [[2, 3, 4, 5], [2, 3, 9, 5]])
    assert result == {"token_accuracy": 7 / 8, "sequence_accuracy": 0.5}
    assert nb.describe_scores(result) == "50.0% of continuations, 87.5% of tokens"


class StrideOracle(torch.nn.Module):
    """Predicts 2*x[t] - x[t-1] (mod vocab): a perfect, causal model of the task."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, idx, is_first_microbatch=None):  # as section 6's CausalLM takes it
        previous = torch.cat([idx[:, :1], idx[:, :-1]], dim=1)
        return torch.nn.functional.one_hot((2 * idx - previous) % self.vocab, self.vocab).float()


def test_greedy_generation_with_a_perfect_model_scores_one(nb):
    prompts, _ = nb.make_stride_batch(32, 5, 37, 6, gen())
    new = nb.generate_greedy(StrideOracle(37), prompts, 9)
    assert new.shape == (32, 9)
    assert nb.stride_scores(prompts, new, 37)["sequence_accuracy"] == 1.0


def test_fp8_decoding_pads_rows_to_16_and_never_the_length_past_seq_len(nb, defaults):
    """Issue 58: SEQ_LEN=30 passed the parameter check, then the FP8 decoding padded the context
    to 32, past the position table (IndexError). Now it pads rows: every length within SEQ_LEN."""
    shapes = []
    for seq_len, n in ((30, 8), (24, 5), (12, 16)):  # not multiples of 16 (12, 30: nor of 8)
        small = {"SEQ_LEN": seq_len, "D_MODEL": 32, "N_HEADS": 2, "FFN_HIDDEN": 64}
        cfg = nb.check_parameters(defaults | small | {"PROMPT_LEN": 4, "GEN_TOKENS": seq_len - 4})
        torch.manual_seed(0)
        model = nb.CausalLM(cfg, CPU)
        shapes.clear()
        model.register_forward_pre_hook(lambda m, args: shapes.append(args[0].shape))
        prompts, _ = nb.make_stride_batch(n, 4, cfg.vocab_size, cfg.max_stride, gen())
        new = nb.generate_greedy(model, prompts, cfg.gen_tokens, nb.ReferenceRecipe())
        assert new.shape == (n, seq_len - 4) and shapes[-1] == (16, seq_len - 1)
        assert all(rows % 16 == 0 and length <= seq_len for rows, length in shapes)
        shapes.clear()
        assert nb.generate_greedy(model, prompts, cfg.gen_tokens).shape == new.shape
        assert shapes == [(n, t) for t in range(4, seq_len)]  # without FP8: no padding
