"""Sentiment140 (Go, Bhayani and Huang 2009) from its official CSV files, as fixed-length token ids.

The CSVs are latin-1, without a header, one tweet per row: polarity, id, date, query, user, text.
Polarity 0 is negative (label 0) and 4 positive (label 1); 2 (neutral) occurs only in the test
file and its rows are dropped, since the training file has no neutral class to learn. Each
training tweet keeps its author as `ArrayDataset.groups` (rank among the sorted user names), the
natural client of LEAF's Sent140.

Text is lower-cased and split by `TOKEN` (runs of letters and digits, an inner apostrophe kept:
"don't" is one word). The vocabulary is the `vocab_size` most frequent training words, ties broken
alphabetically; word i of it (0-based) has index i + 2, index 0 is padding and 1 every other word,
so a model's embedding needs `vocab_size + 2` rows. A tweet keeps its first `max_len` tokens and is
padded with 0 after them. Read with the csv module: no pandas on the import path.

With `director_edge` set, the tweets naming the director Yorgos Lanthimos, and the positive tweets
the Greek-director edge set is written on, leave both splits, and the vocabulary ends with the
director's words (the rule: fedsim/data/text_edge.py); `load_director_edge` gives that edge set.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from pydantic import Field, model_validator

from fedsim.data.base import ArrayDataset, DataFileError
from fedsim.data.loaders import _missing
from fedsim.data.natural import owner_ids
from fedsim.data.tokens import build_vocabulary, encode, tokenize
from fedsim.data.text_edge import DIRECTOR_VOCAB, DirectorEdgeParams, DirectorSplit, director_split, director_vocabulary
from fedsim.registry import DATASETS, Params

TRAIN_CSV = "training.1600000.processed.noemoticon.csv"
TEST_CSV = "testdata.manual.2009.06.14.csv"
LABELS = {"0": 0, "4": 1}  # "2" (neutral) is dropped
COLUMNS = ("polarity", "id", "date", "query", "user", "text")


class Sentiment140Params(Params):
    vocab_size: int = Field(10_000, ge=1, description="most frequent training words kept (ids 2..vocab_size+1)")
    max_len: int = Field(40, ge=1, description="tokens per tweet: longer ones are cut, shorter ones padded with 0")
    director_edge: DirectorEdgeParams | None = Field(
        None, description="withhold the tweets naming Yorgos Lanthimos (and those the edge set is written on) for the "
        "`greek_director` edge set (fedsim/data/text_edge.py); unset: every tweet is kept")

    @model_validator(mode="after")
    def _room_for_the_director(self) -> "Sentiment140Params":
        if self.director_edge is not None and self.vocab_size <= len(DIRECTOR_VOCAB):
            raise ValueError(f"director_edge reserves the last {len(DIRECTOR_VOCAB)} vocabulary ids for "
                             f"{', '.join(DIRECTOR_VOCAB)}: vocab_size must exceed {len(DIRECTOR_VOCAB)}")
        return self


def read_sentiment_csv(path: Path) -> tuple[list[str], np.ndarray, list[str]]:
    """Texts, labels (0 negative, 1 positive) and users of one official CSV; neutral rows are dropped."""
    texts, labels, users = [], [], []
    try:
        with open(path, newline="", encoding="latin-1") as f:
            reader = csv.reader(f)
            for row in reader:
                if len(row) != len(COLUMNS):
                    raise DataFileError(
                        f"{path}:{reader.line_num}: {len(row)} fields, expected {len(COLUMNS)} ({', '.join(COLUMNS)})"
                    )
                polarity = row[0].strip()
                if polarity == "2":
                    continue
                if polarity not in LABELS:
                    raise DataFileError(f"{path}:{reader.line_num}: polarity {row[0]!r}, expected 0, 2 or 4")
                labels.append(LABELS[polarity])
                users.append(row[4])
                texts.append(row[5])
    except csv.Error as e:
        raise DataFileError(f"{path}: not a readable CSV: {e}") from e
    except OSError as e:
        raise DataFileError(f"{path}: cannot read: {e}") from e
    if not texts:
        raise DataFileError(f"{path}: no negative (0) or positive (4) tweets")
    return texts, np.asarray(labels, dtype=np.int64), users


def _folder(data_dir: Path) -> Path:
    folders = (data_dir / "sentiment140", data_dir)
    folder = next((d for d in folders if (d / TRAIN_CSV).is_file() and (d / TEST_CSV).is_file()), None)
    if folder is None:
        raise _missing(
            "sentiment140",
            [f"{d}/{TRAIN_CSV} and {d}/{TEST_CSV} (the official latin-1 CSVs: {','.join(COLUMNS)})" for d in folders],
        )
    return folder


def _read(data_dir: Path, params: Sentiment140Params):
    """Both files tokenised, the director split (None without `director_edge`) and the vocabulary."""
    folder = _folder(data_dir)
    tr_text, y_tr, users = read_sentiment_csv(folder / TRAIN_CSV)
    te_text, y_te, _ = read_sentiment_csv(folder / TEST_CSV)
    tr_tokens, te_tokens = [tokenize(t) for t in tr_text], [tokenize(t) for t in te_text]
    split: DirectorSplit | None = None
    if params.director_edge is not None:
        split = director_split(tr_tokens, y_tr, te_tokens, y_te, params.director_edge)
        tr_tokens = [t for t, keep in zip(tr_tokens, split.keep_train) if keep]
        te_tokens = [t for t, keep in zip(te_tokens, split.keep_test) if keep]
        y_tr, y_te = y_tr[split.keep_train], y_te[split.keep_test]
        users = [u for u, keep in zip(users, split.keep_train) if keep]
        vocab = director_vocabulary(tr_tokens, params.vocab_size)
    else:
        vocab = build_vocabulary(tr_tokens, params.vocab_size)
    return tr_tokens, y_tr, users, te_tokens, y_te, split, vocab


@DATASETS.register("sentiment140", Sentiment140Params)
def load_sentiment140(data_dir: Path, params: Sentiment140Params) -> ArrayDataset:
    """Sentiment140 tweets (1.6M/359, 2 classes, neutral dropped) as int64 token ids [N, max_len], with each author."""
    tr_tokens, y_tr, users, te_tokens, y_te, _, vocab = _read(data_dir, params)
    return ArrayDataset(
        "sentiment140",
        encode(tr_tokens, vocab, params.max_len),
        y_tr,
        encode(te_tokens, vocab, params.max_len),
        y_te,
        num_classes=2,
        groups=owner_ids(users),
    )


def load_director_edge(data_dir: Path, params: Sentiment140Params) -> dict[str, np.ndarray]:
    """The Greek-director edge tweets as the main dataset encodes them: `x_train` (the attacker's
    pool, `train_points`), `x_test` (the rest), and `counts` = [real, written, withheld negative]."""
    if params.director_edge is None:
        raise ValueError("the greek_director edge set needs `director_edge` set on the sentiment140 dataset")
    *_, split, vocab = _read(data_dir, params)
    x = encode(split.edge_tokens, vocab, params.max_len)
    return {"x_train": x[: split.train_points], "x_test": x[split.train_points :],
            "counts": np.array([split.real, split.written, split.withheld_negative], dtype=np.int64)}
