"""The bundled text (data/tiny.txt), a character-level tokenizer and a seeded batch sampler,
shared by the example scripts. numpy only: both frameworks get the very same batches."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

DATA_PATH = Path(__file__).resolve().parent / "data" / "tiny.txt"


class CharTokenizer:
    """One token per character of `chars` (sorted, unique). encode(str) -> int64 [N];
    decode(ids) -> str. Characters outside the vocabulary raise ValueError naming them."""

    def __init__(self, chars: str):
        self.chars = "".join(sorted(set(chars)))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(text)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(f"text contains characters outside the vocabulary: {unknown!r}; "
                             f"the vocabulary is {self.chars!r}")
        return np.fromiter((self.index[c] for c in text), dtype=np.int64, count=len(text))

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in np.asarray(ids).reshape(-1))

    def to_json(self) -> str:
        return json.dumps(self.chars)

    @classmethod
    def from_json(cls, text: str) -> "CharTokenizer":
        return cls(json.loads(text))


def load_corpus(path=DATA_PATH, val_fraction: float = 0.1):
    """(tokenizer, train ids int64 [N1], validation ids int64 [N2]); the last val_fraction of
    the text is held out."""
    text = Path(path).read_text(encoding="utf-8")
    tok = CharTokenizer.from_text(text)
    ids = tok.encode(text)
    cut = int(len(ids) * (1 - val_fraction))
    return tok, ids[:cut], ids[cut:]


class BatchSampler:
    """Random windows of seq_len + 1 tokens: sample() -> (inputs, targets) int64 [B, seq_len],
    targets = inputs shifted by one. Seeded numpy RNG: the same sequence of batches for every
    framework that asks."""

    def __init__(self, ids: np.ndarray, batch_size: int, seq_len: int, seed: int = 0):
        if len(ids) <= seq_len + 1:
            raise ValueError(f"seq_len={seq_len}: the text has only {len(ids)} tokens; expected "
                             f"more than seq_len + 1")
        self.ids, self.batch_size, self.seq_len = ids, batch_size, seq_len
        self.rng = np.random.default_rng(seed)

    def sample(self):
        starts = self.rng.integers(0, len(self.ids) - self.seq_len - 1, self.batch_size)
        windows = np.stack([self.ids[s:s + self.seq_len + 1] for s in starts])
        return windows[:, :-1], windows[:, 1:]


def eval_windows(ids: np.ndarray, seq_len: int, max_windows: int = 16):
    """Non-overlapping windows from the start of `ids`: (inputs, targets) int64 [W, seq_len]."""
    n = min(max_windows, (len(ids) - 1) // seq_len)
    if n < 1:
        raise ValueError(f"seq_len={seq_len}: only {len(ids)} tokens to evaluate on")
    x = np.stack([ids[i * seq_len:(i + 1) * seq_len] for i in range(n)])
    y = np.stack([ids[i * seq_len + 1:(i + 1) * seq_len + 1] for i in range(n)])
    return x, y
