"""Attack of the Tails scenarios at the paper's scale and their CPU twins (issue #18, item 5).

scenarios/paper/cifar10_southwest_*.yaml and emnist_ardis_*.yaml set the paper's numbers; each has a
`*_cpu.yaml` twin that runs here. The expected values below are copied from the paper's numbers
(docs/paper_scale.md, "The paper's numbers": 1.2 data, 1.3 models, 1.4 protocol, 1.5 attacker
modes, 1.6 frequency, 1.7 defenses), not read from the files, so a file that drifts fails here.

The paper-scale runs need CIFAR-10 / EMNIST files and a GPU, neither present on the development
machine: they are only validated. One CPU twin runs two rounds in-process on the LocalGrid when
MNIST and ARDIS are in $FEDSIM_DATA_DIR (or ../shared/data).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedsim.flower.local_grid import LocalGrid
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.scenario import load_scenario
from fedsim.server.app import run_server

from conftest import REPO, data_dir

PAPER = REPO / "scenarios" / "paper"
VARIANTS = ("blackbox", "blackbox_clip", "pgd", "pgd_clip", "pgd_replacement", "pgd_replacement_clip")

# docs/paper_scale.md, "The paper's numbers", one row per task.
TASKS = {
    "cifar10_southwest": dict(
        dataset="cifar10", model="vgg9", num_clients=200, clients_per_round=10, rounds=500,  # 1.4
        local_epochs=2, batch_size=32, lr=0.02, lr_decay=0.998, momentum=0.9, weight_decay=1e-4,  # 1.4
        alpha=0.5, min_partition_size=10, seed=7,  # 1.4
        edge_set="southwest", target_class=9, num_edge=100, num_clean=400,  # 1.2
        every=10, first=1, eps=2.0, delta=2.0,  # 1.6, 1.5 (README eps), 1.7 (README delta)
    ),
    "emnist_ardis": dict(
        dataset="emnist", model="lenet", num_clients=3383, clients_per_round=30, rounds=500,  # 1.4
        local_epochs=5, batch_size=512, lr=0.1, lr_decay=0.998, momentum=0.9, weight_decay=1e-4,  # 1.4
        alpha=0.5, min_partition_size=10, seed=7,  # 1.4
        edge_set="ardis", target_class=1, num_edge=66, num_clean=100,  # 1.2
        every=10, first=1, eps=1.0, delta=1.5,  # 1.6, 1.5, 1.7
    ),
}
# Protocol numbers each CPU twin keeps from its task (the rest is named in the twin's header).
KEPT_BY_TWIN = ("clients_per_round", "local_epochs", "batch_size", "lr", "lr_decay", "momentum", "weight_decay",
                "alpha", "min_partition_size", "seed", "num_edge", "num_clean", "eps", "delta")

PAPER_FILES = [(task, v) for task in TASKS for v in VARIANTS]


def numbers(sc) -> dict:
    """The scenario's values under the names of TASKS."""
    fed, att = sc.federation, sc.attack
    clip = [d for d in sc.defenses if d.name == "norm_clipping"]
    return dict(
        dataset=sc.data.dataset.name, model=sc.model.name, num_clients=fed.num_clients,
        clients_per_round=fed.clients_per_round, rounds=fed.rounds, local_epochs=fed.local_epochs,
        batch_size=fed.batch_size, lr=fed.lr, lr_decay=fed.lr_decay, momentum=fed.momentum,
        weight_decay=fed.weight_decay, alpha=sc.data.partition.alpha,
        min_partition_size=sc.data.partition.min_partition_size, seed=sc.seed,
        edge_set=att.edge_set.name, target_class=att.edge_set.target_class, num_edge=att.num_edge,
        num_clean=att.num_clean, every=att.schedule.every, first=att.schedule.first, eps=att.eps,
        delta=clip[0].delta if clip else None,
    )


def check_variant(sc, variant: str, expected: dict) -> None:
    mode = variant.removesuffix("_clip")
    assert sc.attack.name == "edge_case" and sc.attack.mode == mode
    assert sc.attack.num_attackers == 1 and sc.attack.schedule.name == "fixed_frequency"  # 1.6
    assert sc.aggregator.name == "fedavg"  # 1.4
    assert [d.name for d in sc.defenses] == (["norm_clipping"] if variant.endswith("_clip") else [])  # 1.7


@pytest.mark.parametrize("task,variant", PAPER_FILES, ids=[f"{t}_{v}" for t, v in PAPER_FILES])
def test_paper_scale_file_has_the_papers_numbers(task, variant):
    sc = load_scenario(PAPER / f"{task}_{variant}.yaml")
    expected = TASKS[task]
    check_variant(sc, variant, expected)
    got = numbers(sc)
    for key, want in expected.items():
        if key == "delta" and not variant.endswith("_clip"):
            assert got["delta"] is None
            continue
        if key == "eps" and variant.startswith("blackbox"):
            continue  # the radius of PGD; black-box has none
        assert got[key] == pytest.approx(want) if isinstance(want, float) else got[key] == want, (key, got[key], want)
    assert sc.name == f"{task}_{variant}"
    # runnable where a GPU is: every device `auto`, a quarter of a GPU per client actor
    assert (sc.federation.device, sc.server.device, sc.evaluation.device) == ("auto", "auto", "auto")
    assert sc.federation.client_gpus == 0.25
    assert sc.evaluation.test_subset is None  # the whole test set, as the paper
    assert sc.init.pretrain_epochs == 10  # 1.3: the official runs start from a 10-epoch checkpoint
    if task == "emnist_ardis":
        assert sc.data.dataset.split == "digits"


@pytest.mark.parametrize("task,variant", PAPER_FILES, ids=[f"{t}_{v}_cpu" for t, v in PAPER_FILES])
def test_cpu_twin_validates_and_keeps_the_protocol(task, variant):
    sc = load_scenario(PAPER / f"{task}_{variant}_cpu.yaml")
    expected = TASKS[task]
    check_variant(sc, variant, expected)
    got = numbers(sc)
    for key in KEPT_BY_TWIN:
        if (key == "delta" and not variant.endswith("_clip")) or (key == "eps" and variant.startswith("blackbox")):
            continue
        assert got[key] == pytest.approx(expected[key]), (key, got[key], expected[key])
    # what the header says differs: MNIST + ARDIS + LeNet, no more clients and far fewer rounds, all on CPU
    assert (got["dataset"], got["model"], got["edge_set"]) == ("mnist", "lenet", "ardis")
    assert got["num_clients"] <= expected["num_clients"] and got["rounds"] <= 4
    assert (sc.federation.device, sc.server.device, sc.evaluation.device, sc.federation.client_gpus) == ("cpu",) * 3 + (0,)
    header = (PAPER / f"{task}_{variant}_cpu.yaml").read_text().split("\nname:")[0]
    assert f"CPU twin of {task}_{variant}.yaml" in header and "differs" in header


def test_every_paper_file_has_a_twin_and_says_where_its_numbers_come_from():
    for task, variant in PAPER_FILES:
        text = (PAPER / f"{task}_{variant}.yaml").read_text()
        assert f"CPU twin: {task}_{variant}_cpu.yaml" in text
        assert "docs/paper_scale.md" in text and "What differs from the official code" in text
    doc = (REPO / "docs" / "paper_scale.md").read_text()  # the section the headers cite, with its parts
    assert "## The paper's numbers" in doc and all(f"### {n} " in doc for n in ("1.2", "1.3", "1.4", "1.5", "1.6", "1.7", "1.8"))


def test_cpu_twin_runs_two_rounds_in_process(tmp_path):
    root = data_dir()
    needed = ("mnist.npz", "ardis_iv.npz")
    if root is None or not all((root / f).is_file() for f in needed):
        pytest.skip(f"needs {' and '.join(needed)} in $FEDSIM_DATA_DIR or ../shared/data (looked in {root})")
    from fedsim.client.app import make_client_app

    # the twin with the most moving parts: PGD, model replacement, norm-difference clipping
    scenario = load_scenario(PAPER / "cifar10_southwest_pgd_replacement_clip_cpu.yaml",
                             [f"data.dir={root}", "federation.rounds=2", "output.checkpoints=false"])
    run = RunFolder.create(scenario, tmp_path / "run")
    run_server(LocalGrid(make_client_app(scenario), scenario.federation.num_clients), scenario, run)
    rounds = read_rounds(run)
    assert [r["round"] for r in rounds if "round" in r][-2:] == [1, 2], rounds
    attack_round = next(r for r in rounds if r.get("round") == 1)
    assert attack_round.get("attackers"), attack_round  # every 2nd round from round 1: round 1 is attacked
    assert not any(r.get("rejected") for r in rounds)


# --------------------------------------------------------------------------- Sentiment140 "Greek director"
# docs/paper_scale.md 1.2 (Sentiment140: 1948 users, 10 per round, 60 edge points) and the official
# language-tasks-fl/fl-configs/sent140-fl-conf-greek-director-backdoor.yaml, advPts in
# src/dataset/sentiment140_data.py, normBounds and the seed in defense_runner.py.
GREEK = dict(
    dataset="sentiment140", model="lstm", partition="iid", num_clients=1948, clients_per_round=10, rounds=500,
    local_epochs=2, batch_size=20, lr=0.05, lr_decay=1.0, momentum=0.9, weight_decay=1e-4, seed=42,
    embed_dim=200, hidden=200, layers=2, dropout=0.5,
    edge_set="greek_director", target_class=0, num_edge=60, num_clean=140, every=10, first=101,
    eps=2.0, project_every=1, delta=1.5,
)
GREEK_KEPT_BY_TWIN = ("clients_per_round", "local_epochs", "batch_size", "lr", "lr_decay", "momentum", "weight_decay",
                      "seed", "embed_dim", "hidden", "layers", "dropout", "partition", "num_edge", "num_clean", "eps",
                      "project_every", "delta", "dataset", "model", "edge_set", "target_class")


def greek_numbers(sc) -> dict:
    fed, att, m = sc.federation, sc.attack, sc.model
    clip = [d for d in sc.defenses if d.name == "norm_clipping"]
    return dict(
        dataset=sc.data.dataset.name, model=m.name, partition=sc.data.partition.name, num_clients=fed.num_clients,
        clients_per_round=fed.clients_per_round, rounds=fed.rounds, local_epochs=fed.local_epochs,
        batch_size=fed.batch_size, lr=fed.lr, lr_decay=fed.lr_decay, momentum=fed.momentum,
        weight_decay=fed.weight_decay, seed=sc.seed, embed_dim=m.embed_dim, hidden=m.hidden, layers=m.layers,
        dropout=m.dropout, edge_set=att.edge_set.name, target_class=att.edge_set.target_class, num_edge=att.num_edge,
        num_clean=att.num_clean, every=att.schedule.every, first=att.schedule.first, eps=att.eps,
        project_every=att.project_every, delta=clip[0].delta if clip else None,
    )


def check_greek(sc, variant: str, keys) -> None:
    check_variant(sc, variant, GREEK)
    got = greek_numbers(sc)
    for key in keys:
        if (key == "delta" and not variant.endswith("_clip")) or (key in ("eps", "project_every") and variant.startswith("blackbox")):
            continue
        want = GREEK[key]
        assert got[key] == pytest.approx(want) if isinstance(want, float) else got[key] == want, (key, got[key], want)
    if not variant.endswith("_clip"):
        assert got["delta"] is None
    ds = sc.data.dataset
    assert ds.director_edge is not None  # the edge tweets leave the honest clients' data
    assert sc.model.vocab_size == ds.vocab_size + 2  # text.py: the words + PAD and UNKNOWN


@pytest.mark.parametrize("variant", VARIANTS)
def test_sentiment140_greek_paper_file_has_the_papers_numbers(variant):
    name = f"sentiment140_greek_{variant}"
    sc = load_scenario(PAPER / f"{name}.yaml")
    check_greek(sc, variant, GREEK)
    assert sc.name == name and sc.init.pretrain_epochs == 0  # the 100 clean rounds run in fedsim
    assert (sc.federation.device, sc.server.device, sc.evaluation.device) == ("auto", "auto", "auto")
    assert sc.federation.client_gpus == 0.25 and sc.evaluation.test_subset is None
    text = (PAPER / f"{name}.yaml").read_text()
    assert f"CPU twin: {name}_cpu.yaml" in text and "docs/paper_scale.md" in text and "What differs from the official code" in text


@pytest.mark.parametrize("variant", VARIANTS)
def test_sentiment140_greek_cpu_twin_keeps_the_protocol(variant):
    name = f"sentiment140_greek_{variant}"
    sc = load_scenario(PAPER / f"{name}_cpu.yaml")
    check_greek(sc, variant, GREEK_KEPT_BY_TWIN)
    got = greek_numbers(sc)
    assert got["num_clients"] <= GREEK["num_clients"] and got["rounds"] <= 4
    assert (sc.federation.device, sc.server.device, sc.evaluation.device, sc.federation.client_gpus) == ("cpu",) * 3 + (0,)
    header = (PAPER / f"{name}_cpu.yaml").read_text().split("\nname:")[0]
    assert f"CPU twin of {name}.yaml" in header and "differs" in header


def run_greek_twin(tmp_path, monkeypatch, *overrides) -> list[dict]:
    """The twin with the most moving parts (PGD, model replacement, clipping), in-process on the
    LocalGrid, on official-format CSVs the test writes; its rounds.jsonl records."""
    from fedsim.client.app import make_client_app
    from test_text_edge import write_corpus

    monkeypatch.setenv("FEDSIM_CACHE_DIR", str(tmp_path / "cache"))
    write_corpus(tmp_path / "data")
    scenario = load_scenario(PAPER / "sentiment140_greek_pgd_replacement_clip_cpu.yaml",
                             [f"data.dir={tmp_path / 'data'}", "output.checkpoints=false", *overrides])
    run = RunFolder.create(scenario, tmp_path / "run")
    run_server(LocalGrid(make_client_app(scenario), scenario.federation.num_clients), scenario, run)
    return [r for r in read_rounds(run) if "round" in r]


def test_sentiment140_greek_twin_pipeline_one_round_small_lstm(tmp_path, monkeypatch):
    """The default suite's end-to-end check: the twin's pipeline for one attacked round, with a
    16-wide one-layer LSTM so that it takes seconds (the twin itself: the slow test below)."""
    rounds = run_greek_twin(tmp_path, monkeypatch, "federation.rounds=1", "model.embed_dim=16", "model.hidden=16",
                            "model.layers=1", "model.dropout=0")
    assert [r["round"] for r in rounds] == [0, 1] and rounds[1].get("attackers"), rounds
    assert all(r["backdoor_success"] is not None for r in rounds)


@pytest.mark.slow
def test_sentiment140_greek_cpu_twin_runs_two_rounds_on_a_written_csv(tmp_path, monkeypatch):
    rounds = run_greek_twin(tmp_path, monkeypatch, "federation.rounds=2")
    assert [r["round"] for r in rounds][-2:] == [1, 2], rounds
    attacked = next(r for r in rounds if r["round"] == 1)
    assert attacked.get("attackers"), attacked  # every 2nd round from round 1
    for r in rounds:  # 40 edge test tweets: the share is a count over 40
        assert r["backdoor_success"] is not None and round(r["backdoor_success"] * 40, 6) == int(round(r["backdoor_success"] * 40))
    assert not any(r.get("rejected") for r in rounds)
