"""Data tasks: correct addition sequences, deterministic batches, char corpus, MLM masking."""
import numpy as np
import pytest

from osdp_jax.cli import data


def test_addition_sequences_are_correct_and_deterministic():
    task = data.Addition(digits=2, seed=0)
    seq, weights = task.sequences(step=5, batch_size=64)
    assert seq.shape == (64, 7) and weights.shape == (64, 6)
    a = seq[:, 0] * 10 + seq[:, 1]
    b = seq[:, 2] * 10 + seq[:, 3]
    c = seq[:, 4] + 10 * seq[:, 5] + 100 * seq[:, 6]  # the sum's digits come reversed
    np.testing.assert_array_equal(a + b, c)
    assert weights[:, :3].sum() == 0 and weights[:, 3:].min() == 1
    np.testing.assert_array_equal(task.sequences(5, 64)[0], seq)
    assert not np.array_equal(task.sequences(6, 64)[0], seq)
    test = set(task.test_problems().tolist())
    assert len(test) == 500
    train_ids = {int(x) for x in (a * 100 + b)}
    assert not train_ids & test  # held-out problems never appear in training batches


def test_chars_corpus(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("hello world, " * 50)
    task = data.Chars(str(path), seq_len=16, seed=1)
    assert task.vocab_size == len(set("hello world, "))
    seq, w = task.sequences(0, 4)
    assert seq.shape == (4, 17) and w.shape == (4, 16)
    np.testing.assert_array_equal(seq, task.sequences(0, 4)[0])
    with pytest.raises(ValueError, match="not a readable file"):
        data.Chars(str(tmp_path / "missing.txt"), 16, 0)


def test_mlm_batches_mask_a_fixed_count():
    task = data.RandomTokens(vocab_size=99, seq_len=20, seed=0)
    batch = data.make_batch(task, "mlm", step=3, batch_size=8, vocab_size=100, seed=0)
    assert (batch["weights"].sum(axis=1) == 3).all()  # round(0.15 * 20)
    masked = batch["weights"] > 0
    assert (batch["inputs"][masked] == 99).all()
    np.testing.assert_array_equal(batch["inputs"][~masked], batch["targets"][~masked])
    causal = data.make_batch(task, "causal", step=3, batch_size=8, vocab_size=100, seed=0)
    np.testing.assert_array_equal(causal["inputs"][:, 1:], causal["targets"][:, :-1])
