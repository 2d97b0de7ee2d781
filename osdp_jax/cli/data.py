"""Data for the experiments: minGPT addition, a character corpus from a local file, random tokens.

Every batch is a pure function of (seed, step), so a run is reproducible and resumes at any step.
A task yields token sequences; the model's objective turns them into ``{"inputs", "targets",
"weights"}`` (next-token prediction for decoders, masked tokens for BERT).
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

MLM_FRACTION = 0.15  # share of positions masked per sequence (a fixed count per row)


def _rng(seed: int, step: int, stream: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, stream, step])


@dataclasses.dataclass(frozen=True)
class Addition:
    """minGPT's n-digit addition: ``a b`` then the digits of ``a + b`` reversed; loss on the sum."""

    digits: int
    seed: int
    test_size: int = 500

    vocab_size = 10

    @property
    def seq_len(self) -> int:  # model input length: 2n digits + (n+1) sum digits - 1 shifted
        return 3 * self.digits + 1

    def _split(self):
        n_total = (10 ** self.digits) ** 2
        perm = np.random.default_rng([self.seed, 99]).permutation(n_total)
        n_test = min(self.test_size, n_total // 5)
        return perm[n_test:], perm[:n_test]

    def encode(self, problems: np.ndarray) -> np.ndarray:
        """Problem ids (a * 10^n + b) -> digit sequences (B, 3n + 1)."""
        n = self.digits
        a, b = np.divmod(problems, 10**n)
        c = a + b
        def digits_of(x, k):  # most significant first
            return (x[:, None] // 10 ** np.arange(k - 1, -1, -1)) % 10
        return np.concatenate([digits_of(a, n), digits_of(b, n), digits_of(c, n + 1)[:, ::-1]], axis=1)

    def sequences(self, step: int, batch_size: int, rows: slice = slice(None)):
        train, _ = self._split()
        seq = self.encode(train[_rng(self.seed, step).integers(0, len(train), batch_size)[rows]])
        weights = np.zeros((seq.shape[0], seq.shape[1] - 1), np.float32)
        weights[:, 2 * self.digits - 1:] = 1.0  # predict only the sum's digits
        return seq, weights

    def test_problems(self) -> np.ndarray:
        return self._split()[1]


@dataclasses.dataclass(frozen=True)
class Chars:
    """Character-level text from a local file; random windows of ``seq_len + 1`` characters."""

    path: str
    seq_len: int
    seed: int

    def __post_init__(self):
        p = pathlib.Path(self.path)
        if not p.is_file():
            raise ValueError(f"data.path {self.path!r} is not a readable file; give a local text file")
        text = p.read_text(encoding="utf-8", errors="replace")
        if len(text) <= self.seq_len + 1:
            raise ValueError(f"data.path {self.path!r} has {len(text)} characters, fewer than "
                             f"data.seq_len + 2 = {self.seq_len + 2}")
        chars = sorted(set(text))
        object.__setattr__(self, "_ids", _lookup(text, chars))
        object.__setattr__(self, "vocab_size", len(chars))

    def sequences(self, step: int, batch_size: int, rows: slice = slice(None)):
        ids = self._ids
        starts = _rng(self.seed, step).integers(0, len(ids) - self.seq_len - 1, batch_size)[rows]
        seq = np.stack([ids[s:s + self.seq_len + 1] for s in starts])
        return seq, np.ones((len(starts), self.seq_len), np.float32)


def _lookup(text: str, chars: list[str]) -> np.ndarray:
    table = {c: i for i, c in enumerate(chars)}
    return np.fromiter((table[c] for c in text), dtype=np.int32, count=len(text))


@dataclasses.dataclass(frozen=True)
class RandomTokens:
    """Uniform random tokens, for throughput runs."""

    vocab_size: int
    seq_len: int
    seed: int

    def sequences(self, step: int, batch_size: int, rows: slice = slice(None)):
        # the tokens are the random draw itself: drawn for the whole batch, then cut to ``rows``
        seq = _rng(self.seed, step).integers(0, self.vocab_size, (batch_size, self.seq_len + 1), dtype=np.int32)[rows]
        return seq, np.ones((seq.shape[0], self.seq_len), np.float32)


def make_batch(task, objective: str, step: int, batch_size: int, vocab_size: int, seed: int,
               rows: slice = slice(None)) -> dict:
    """The model-ready global batch for ``step``: int32 inputs/targets, float32 weights (B, T).

    ``rows``: only these rows of it (a process's share; the addition and character tasks draw
    just the global batch's indices and build only these rows).
    """
    seq, weights = task.sequences(step, batch_size, rows)
    seq = seq.astype(np.int32)
    if objective == "causal":
        return {"inputs": seq[:, :-1], "targets": seq[:, 1:], "weights": weights}
    if objective == "mlm":
        tokens = seq[:, :-1]
        b, t = tokens.shape
        k = max(1, round(MLM_FRACTION * t))
        rng = _rng(seed, step, stream=1)
        masked = np.argsort(rng.random((batch_size, t))[rows], axis=1)[:, :k]
        w = np.zeros((b, t), np.float32)
        np.put_along_axis(w, masked, 1.0, axis=1)
        inputs = np.where(w > 0, vocab_size - 1, tokens).astype(np.int32)  # last id is [MASK]
        return {"inputs": inputs, "targets": tokens, "weights": w}
    raise ValueError(f"unknown objective {objective!r}")
