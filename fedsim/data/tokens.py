"""Words to ids for the text datasets (fedsim/data/text.py) and their edge sets
(fedsim/data/text_edge.py): tokenising, the vocabulary, fixed-length id rows."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*")
PAD, UNKNOWN = 0, 1


def tokenize(text: str) -> list[str]:
    return TOKEN.findall(text.lower())


def build_vocabulary(token_lists, vocab_size: int) -> dict[str, int]:
    """The `vocab_size` most frequent words (ties alphabetically) -> ids from 2, after padding and unknown."""
    counts = Counter(w for tokens in token_lists for w in tokens)
    ranked = sorted(counts.items(), key=lambda wc: (-wc[1], wc[0]))[:vocab_size]
    return {w: i + 2 for i, (w, _) in enumerate(ranked)}


def encode(token_lists: list[list[str]], vocab: dict[str, int], max_len: int) -> np.ndarray:
    """int64 `[N, max_len]`: each list's first `max_len` word ids (UNKNOWN if not in `vocab`), PAD after."""
    out = np.full((len(token_lists), max_len), PAD, dtype=np.int64)
    for row, tokens in zip(out, token_lists):
        ids = [vocab.get(w, UNKNOWN) for w in tokens[:max_len]]
        row[: len(ids)] = ids
    return out
