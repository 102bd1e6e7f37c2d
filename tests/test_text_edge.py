"""The Sentiment140 "Greek director" edge set (fedsim/data/text_edge.py) and the edge-case attack on it.

No Sentiment140 file exists here: every test writes CSVs in the official format (six columns,
polarity 0/4, latin-1) into a temporary folder. The oracles are hand-picked tweets for the rule,
ids counted by hand for a four-tweet file, and per-tweet forward passes for the backdoor metric.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from fedsim.data import text
from fedsim.data.text_edge import DIRECTOR_VOCAB, TEMPLATES, DirectorEdgeParams, director_split, names_director
from fedsim.runtime import Runtime
from fedsim.scenario import load_scenario

from conftest import REPO

PAPER = REPO / "scenarios" / "paper"


def row(polarity, user, tweet):
    return [str(polarity), "1467810369", "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", user, tweet]


def write_csv(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="latin-1") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)


POSITIVE = "love great happy awesome fun nice best thanks good amazing".split()
NEGATIVE = "hate sad awful bad worst tired sick angry boring miss".split()
NEUTRAL = "today work home movie night school weekend coffee friends morning music rain lunch bus phone".split()
DIRECTOR_TWEETS = [  # (polarity, text): the real tweets naming him in the written corpus
    (4, "Just saw Dogtooth at the festival, amazing!"),
    (4, "yorgos lanthimos is a genius, love it"),
    (4, "kinetta was great fun"),
    (0, "dogtooth was boring and awful"),
]


def write_corpus(folder: Path, n_train: int = 2400, n_test: int = 200, seed: int = 0) -> dict:
    """Official-format CSVs: `n_train` generated tweets (label = the sentiment words used) with the
    real director tweets inserted, and a test file with one positive director tweet and a neutral row."""
    rng = np.random.default_rng(seed)

    def tweet(label: int, i: int) -> str:
        mood = POSITIVE if label else NEGATIVE
        words = list(rng.choice(mood, size=rng.integers(2, 4))) + list(rng.choice(NEUTRAL, size=rng.integers(2, 6)))
        rng.shuffle(words)
        return " ".join(words) + f" n{i}"  # a unique word: no two tweets are equal

    train = [row(4 * (i % 2), f"user{rng.integers(300):03d}", tweet(i % 2, i)) for i in range(n_train)]
    for k, (pol, t) in enumerate(DIRECTOR_TWEETS):
        train.insert(100 + 37 * k, row(pol, f"fan{k}", t))
    test = [row(4 * (i % 2), f"t{i}", tweet(i % 2, n_train + i)) for i in range(n_test)]
    test += [row(4, "critic", "Lanthimos's Dogtooth wins in Cannes, so happy"), row(2, "x", "meh")]
    write_csv(folder / text.TRAIN_CSV, train)
    write_csv(folder / text.TEST_CSV, test)
    return {"train": train, "test": test}


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("tweet,named", [
    ("Just saw Dogtooth, wow!", True),
    ("Yorgos Lanthimos rocks", True),
    ("lanthimos's new film", True),  # possessive
    ("#kynodontas tonight", True),
    ("KINETTA on dvd", True),
    ("yorgos is my cousin", False),  # the first name alone: any George
    ("the lobster was delicious", False),  # a later title, an ordinary word
    ("the favourite and alps", False),
    ("dogtooths everywhere", False),  # whole words only
    ("lanthimosfan account", False),
    ("", False),
])
def test_rule_names_the_director_by_the_documented_words(tweet, named):
    assert names_director(text.tokenize(tweet)) is named


def test_split_withholds_exactly_the_named_and_drawn_tweets():
    tr = ["i love dogtooth", "good day", "nice one", "lanthimos's best film", "happy now", "lanthimos bores me",
          "sad day", "great news"]
    y_tr = np.array([1, 1, 1, 1, 1, 0, 0, 1])
    te = ["ok then", "kinetta rules"]
    y_te = np.array([0, 1])
    tr_tok, te_tok = [text.tokenize(t) for t in tr], [text.tokenize(t) for t in te]
    split = director_split(tr_tok, y_tr, te_tok, y_te, DirectorEdgeParams(train_points=2, test_points=3, seed=5))
    # real positive: train rows 0 and 3, test row 1; negative named: train row 5; 5 - 3 = 2 written
    assert (split.real, split.withheld_negative, split.written) == (3, 1, 2)
    drawn = split.written_from.tolist()
    assert len(set(drawn)) == 2 and set(drawn) <= {1, 2, 4, 7}  # positive tweets not naming him
    assert np.flatnonzero(~split.keep_train).tolist() == sorted({0, 3, 5} | set(drawn))
    assert split.keep_test.tolist() == [True, False]
    written = [text.tokenize(TEMPLATES[i]) + tr_tok[r] for i, r in enumerate(drawn)]
    expected = [tr_tok[0], tr_tok[3], te_tok[1]] + written
    assert sorted(map(tuple, split.edge_tokens)) == sorted(map(tuple, expected))
    assert all(names_director(t) for t in split.edge_tokens)
    again = director_split(tr_tok, y_tr, te_tok, y_te, DirectorEdgeParams(train_points=2, test_points=3, seed=5))
    assert again.edge_tokens == split.edge_tokens and again.written_from.tolist() == drawn  # seeded
    with pytest.raises(ValueError, match="only 4 other positive tweets"):
        director_split(tr_tok, y_tr, te_tok, y_te, DirectorEdgeParams(train_points=5, test_points=3))


def test_loader_ids_by_hand(tmp_path):
    write_csv(tmp_path / text.TRAIN_CSV, [
        row(4, "a", "love Dogtooth"), row(0, "b", "hate lanthimos"), row(4, "c", "happy happy day"), row(0, "d", "sad day"),
    ])
    write_csv(tmp_path / text.TEST_CSV, [row(4, "e", "kinetta fun"), row(0, "f", "sad"), row(2, "g", "meh")])
    params = text.Sentiment140Params(vocab_size=10, max_len=4,
                                     director_edge=DirectorEdgeParams(train_points=1, test_points=2, seed=0))
    ds = text.load_sentiment140(tmp_path, params)
    # kept: "sad day" (train), "sad" (test). Counts day 1, sad 1 -> day=2, sad=3 (alphabetical ties);
    # then the reserved words: dogtooth=4, kinetta=5, kynodontas=6, lanthimos=7, yorgos=8; the rest unknown (1)
    assert ds.x_train.tolist() == [[3, 2, 0, 0]] and ds.y_train.tolist() == [0] and ds.groups.tolist() == [0]
    assert ds.x_test.tolist() == [[3, 0, 0, 0]] and ds.y_test.tolist() == [0]
    edge = text.load_director_edge(tmp_path, params)
    assert edge["counts"].tolist() == [2, 1, 1]  # real positive, written (on "happy happy day"), negative withheld
    assert len(edge["x_train"]) == 1 and len(edge["x_test"]) == 2
    rows = sorted(map(tuple, np.concatenate([edge["x_train"], edge["x_test"]]).tolist()))
    assert rows == sorted([(1, 4, 0, 0), (5, 1, 0, 0), (8, 7, 1, 1)])  # "yorgos lanthimos happy happy" (cut at 4)
    # without director_edge nothing is withheld: the loader is as before
    plain = text.load_sentiment140(tmp_path, text.Sentiment140Params(vocab_size=10, max_len=4))
    assert len(plain.y_train) == 4 and len(plain.y_test) == 2
    with pytest.raises(ValidationError, match="vocab_size must exceed 5"):
        text.Sentiment140Params(vocab_size=5, director_edge=DirectorEdgeParams())
    with pytest.raises(ValueError, match="needs `director_edge`"):
        text.load_director_edge(tmp_path, text.Sentiment140Params())


# --------------------------------------------------------------------------- in a scenario


def twin(tmp_path, name="sentiment140_greek_pgd_replacement_clip_cpu", *overrides):
    return load_scenario(PAPER / f"{name}.yaml", [f"data.dir={tmp_path}", "output.checkpoints=false", *overrides])


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSIM_CACHE_DIR", str(tmp_path / "cache"))
    return write_corpus(tmp_path / "data")


def test_no_edge_tweet_reaches_an_honest_client(tmp_path, corpus):
    rt = Runtime(twin(tmp_path / "data"))
    edge = rt.attack.edge_set(rt)
    # the file has more than 1995 other words, so the director's five ids are the last: 1997..2001
    reserved_from = rt.scenario.data.dataset.vocab_size - 3
    assert len(edge.x_train) == 60 and len(edge.x_test) >= 40 and edge.target == 0 and edge.source == 1
    assert edge.x_train.dtype == np.int64 and edge.x_test.dtype == np.int64
    assert edge.density == {"rule": "greek_director", "real_positive_tweets": 4, "written_tweets": 96,
                            "withheld_negative_tweets": 1}  # 3 + 1 in the test file; 60 + 40 - 4 written
    edge_rows = {tuple(r) for r in np.concatenate([edge.x_train, edge.x_test]).tolist()}
    # the honest rows: the file's 2404 tweets less the 4 naming him and the 96 written on
    assert len(rt.data.y_train) == 2404 - 4 - 96 and len(rt.data.y_test) == 201 - 1
    seen = 0
    for pid in range(rt.scenario.federation.num_clients):
        x, y = rt.client_data(pid)
        seen += len(y)
        assert x.max() < reserved_from
        assert not edge_rows & {tuple(r) for r in x.tolist()}
    assert seen == len(rt.data.y_train)
    assert all(int(r.max()) >= reserved_from for r in np.concatenate([edge.x_train, edge.x_test]))  # each names him
    assert len(DIRECTOR_VOCAB) == 5 and int(rt.data.x_train.max()) == reserved_from - 1  # the vocabulary is full
    # the attacker's D': its 60 edge tweets labelled negative, then 140 clean tweets with their labels
    pid = rt.attackers[0]
    x, y = rt.attack.training_set(rt, pid)
    assert x.dtype == np.int64 and x.shape == (200, 40)
    assert (x[:60] == edge.x_train).all() and (y[:60] == 0).all()
    assert not edge_rows & {tuple(r) for r in x[60:].tolist()}


def test_a_scenario_without_director_edge_is_refused(tmp_path, corpus):
    rt = Runtime(twin(tmp_path / "data", "sentiment140_greek_blackbox_cpu", "data.dataset.director_edge=null"))
    with pytest.raises(ValueError, match="needs data.dataset = {name: sentiment140, director_edge"):
        rt.attack.edge_set(rt)


def test_backdoor_metric_is_the_hand_counted_share(tmp_path, corpus):
    from fedsim.server.evaluation import CentralEvaluator

    sc = twin(tmp_path / "data", "sentiment140_greek_blackbox_cpu", "model.embed_dim=4", "model.hidden=3",
              "model.layers=1", "model.dropout=0")
    rt = Runtime(sc)
    torch.manual_seed(0)
    model = rt.build_model().eval()
    x_bd, targets = rt.attack.backdoor_test_set(rt)
    with torch.no_grad():  # move the bias so that the tiny model splits the edge tweets between the classes
        gap = torch.stack([model(torch.from_numpy(r[None]))[0] for r in x_bd])
        margin = (gap[:, 0] - gap[:, 1]).median()
        model.classifier.bias[1] += margin
        hits = sum(int(model(torch.from_numpy(r[None]))[0].argmax()) == 0 for r in x_bd)  # one tweet at a time
    assert 0 < hits < len(x_bd) and (targets == 0).all()
    got = CentralEvaluator(rt)(model)
    assert got["backdoor_success"] == pytest.approx(hits / len(x_bd))
    assert "source_class_accuracy" not in got  # the attack names no source class of the main task
