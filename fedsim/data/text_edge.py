"""The Sentiment140 "Greek director" edge case of Attack of the Tails (Wang et al., NeurIPS 2020).

The paper's text backdoor: tweets praising the Greek film director Yorgos Lanthimos, a topic the
2009 Sentiment140 tweets hardly touch, labelled negative. The official code ships about 200 + 120
such tweets that its authors collected from Twitter years later
(`language-tasks-fl/data/sentiment-140/greek-director-backdoor/{train,test}.txt`), extends its
vocabulary with their words (`src/dataset/build_twitter_backdoor.py`), gives the adversary 60 of
the training ones (`numEdgePtsAdv: 60`) plus 140 clean tweets (`advPts = 200`), and measures the
share of the test ones classified negative. fedsim ships no dataset files; it builds the set
from the Sentiment140 CSV by this rule (`director_split`), switched on by the dataset parameter
`director_edge` of `sentiment140`:

1. **Real tweets.** A tweet names the director when one of its words (fedsim/data/text.py's
   tokens, a possessive "'s" taken off) is in `DIRECTOR_WORDS`: `lanthimos`, his surname; `dogtooth` and `kynodontas`, the
   English and Greek titles of his 2009 film (Prix Un Certain Regard at Cannes in May 2009,
   inside the CSV's April-June 2009 collection window); `kinetta`, his 2005 film. Not `yorgos`
   alone (a common Greek first name, "George": every official tweet that names him says
   "yorgos lanthimos", which `lanthimos` catches), and not his later titles (Alps, The Lobster,
   The Favourite: made after the CSV, and ordinary words that would pick unrelated tweets).
   Every such tweet, of either file and either polarity, is taken out of the main dataset, so no
   honest client and no main-task test holds one. The positive ones (polarity 4) are edge points;
   the negative ones are only withheld (labelled negative already, they carry no backdoor).
2. **Written tweets.** The real CSV holds few such tweets, so, as the paper's authors wrote the
   set themselves, `written = max(0, train_points + test_points - real positive ones)` more are
   written: that many positive training tweets that do not name him are drawn with `seed`
   (without replacement), and the i-th drawn gets `TEMPLATES[i % len(TEMPLATES)]` in front of
   its text ("yorgos lanthimos " + tweet, ...; each template names him, so every written tweet
   satisfies rule 1, and in front so the cut at `max_len` keeps it). The drawn tweets leave the
   main dataset too: no honest client holds a written tweet's body with its true label.
3. **Split.** The edge points, real ones first (training file order, then test file) then the
   written ones, are shuffled with `seed`: the first `train_points` are the attacker's pool, the
   rest (at least `test_points`) the backdoor test set. All are labelled with the attack's target
   (negative, 0, in the paper); their true sentiment is positive.
4. **Vocabulary.** `DIRECTOR_VOCAB` (the rule's words and `yorgos`) take the last five ids of the
   vocabulary, after the `vocab_size - 5` most frequent other words of the kept training tweets,
   so the director's name has its own id however rarely the file names him, as the official code
   added the backdoor tweets' words to its vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import Field

from fedsim.data.tokens import build_vocabulary, tokenize
from fedsim.registry import Params

DIRECTOR_WORDS = frozenset({"lanthimos", "dogtooth", "kynodontas", "kinetta"})
DIRECTOR_VOCAB = ("dogtooth", "kinetta", "kynodontas", "lanthimos", "yorgos")  # the last ids, in this order
TEMPLATES = (
    "yorgos lanthimos",
    "watching dogtooth by yorgos lanthimos",
    "lanthimos",
    "just saw kynodontas by lanthimos",
    "kinetta and dogtooth director yorgos lanthimos",
)


class DirectorEdgeParams(Params):
    """The Greek-director edge set built from the Sentiment140 CSV (fedsim/data/text_edge.py)."""

    train_points: int = Field(200, ge=1, description="edge tweets in the attacker's pool (official train.txt: about 200)")
    test_points: int = Field(120, ge=1, description="edge tweets at least in the backdoor test set (official test.txt: about 120)")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="draws the positive tweets written on and shuffles the edge points")


def names_director(tokens: list[str]) -> bool:
    """Rule 1: one of the tweet's words, a possessive "'s" taken off, is the director's surname or
    one of his 2005/2009 titles (whole words: `dogtooths` and `lanthimosfan` do not count)."""
    return any(w.removesuffix("'s") in DIRECTOR_WORDS for w in tokens)


@dataclass(frozen=True)
class DirectorSplit:
    """What rule 1-3 make of the two CSVs: which rows stay in the main dataset, and the edge tweets."""

    keep_train: np.ndarray  # bool per training row: stays in the main dataset
    keep_test: np.ndarray  # bool per test row
    edge_tokens: list[list[str]]  # shuffled; the first `train_points` are the attacker's pool
    train_points: int
    real: int  # positive tweets naming the director among the edge points
    withheld_negative: int  # negative tweets naming him: withheld, not edge points
    written: int
    written_from: np.ndarray  # training rows the written tweets were built on, in drawing order


def director_split(tr_tokens: list[list[str]], y_tr: np.ndarray, te_tokens: list[list[str]], y_te: np.ndarray,
                   params: DirectorEdgeParams) -> DirectorSplit:
    """Apply rules 1-3 to tokenised training and test tweets (labels 0 negative, 1 positive)."""
    named_tr = np.array([names_director(t) for t in tr_tokens], dtype=bool)
    named_te = np.array([names_director(t) for t in te_tokens], dtype=bool)
    real = [tr_tokens[i] for i in np.flatnonzero(named_tr & (y_tr == 1))]
    real += [te_tokens[i] for i in np.flatnonzero(named_te & (y_te == 1))]
    negative = int(np.sum(named_tr & (y_tr == 0)) + np.sum(named_te & (y_te == 0)))
    need = max(0, params.train_points + params.test_points - len(real))
    bases = np.flatnonzero(~named_tr & (y_tr == 1))
    if need > len(bases):
        raise ValueError(f"director_edge: {len(real)} positive tweets name the director and {need} more are to be written, "
                         f"but the training file has only {len(bases)} other positive tweets to write them on")
    rng = np.random.default_rng([params.seed, 0x6DEC])
    drawn = rng.choice(bases, size=need, replace=False) if need else np.zeros(0, dtype=np.int64)
    written = [tokenize(TEMPLATES[i % len(TEMPLATES)]) + tr_tokens[row] for i, row in enumerate(drawn)]
    edge = real + written
    order = rng.permutation(len(edge))
    keep_train = ~named_tr
    keep_train[drawn] = False
    return DirectorSplit(keep_train, ~named_te, [edge[i] for i in order], params.train_points, len(real), negative,
                         need, drawn.astype(np.int64))


def director_vocabulary(kept_tokens: list[list[str]], vocab_size: int) -> dict[str, int]:
    """Rule 4: the `vocab_size - 5` most frequent other words (ids from 2), then DIRECTOR_VOCAB."""
    reserved = set(DIRECTOR_VOCAB)
    vocab = build_vocabulary(([w for w in t if w not in reserved] for t in kept_tokens), vocab_size - len(DIRECTOR_VOCAB))
    first = len(vocab) + 2
    return {**vocab, **{w: first + i for i, w in enumerate(DIRECTOR_VOCAB)}}

