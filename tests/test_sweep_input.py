"""Sweep files that used to crash or hang `fedsim validate` / `fedsim sweep` (#16 items 12, 13):
each is refused with its field path, quickly and without a traceback."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fedsim.cli import main
from fedsim.runs.sweep import MAX_RUNS, expand

REPO = Path(__file__).resolve().parents[1]
BASE = "base: {base}\nfederation: {{rounds: 1}}\n"


@pytest.mark.parametrize("body,needle", [
    ("sweep:\n  federation.rounds.deeper: [1, 2]\n", "is a int, not a section"),
    ("sweep:\n  seed.x: [1]\n", "not a section"),
    ("sweep:\n  1: [1, 2]\n", "swept keys are dotted scenario paths"),
    ("sweep:\n  federation.rounds: 3\n", "non-empty list"),
    ("x: &x [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]\nsweep: {seed: *x, federation.rounds: *x, federation.lr_decay: *x, "
     "evaluation.every: *x, federation.local_epochs: *x, federation.batch_size: *x}\n", f"more than {MAX_RUNS} runs"),
    # a plain section set as a whole would silently drop the keys the scenario sets there
    ("sweep:\n  setting:\n    - {label: small, federation: {batch_size: 2}}\n",
     "sets the section `federation` as a whole, which would drop what the scenario sets there (clients_per_round, "
     "local_epochs, lr, momentum, num_clients, rounds): set dotted keys instead (federation.batch_size: ...)"),
    ("sweep:\n  federation: [{rounds: 2}]\n", "(batch_size, clients_per_round, local_epochs, lr, momentum, num_clients)"),
])
def test_bad_sweeps_are_refused(tmp_path, capsys, body, needle):
    path = tmp_path / "sweep.yaml"
    path.write_text(BASE.format(base=REPO / "scenarios/quickstart.yaml") + body)
    t0 = time.monotonic()
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and time.monotonic() - t0 < 10, err


def test_a_section_set_with_dotted_keys_or_in_full_keeps_or_replaces_it_on_purpose(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(BASE.format(base=REPO / "scenarios/quickstart.yaml") + "sweep:\n  setting:\n"
                    "    - {label: dotted, federation.batch_size: 2}\n"
                    "    - {label: whole, federation: {num_clients: 4, clients_per_round: 2, rounds: 1, batch_size: 3,"
                    " local_epochs: 1, lr: 0.05, momentum: 0.0}}\n")
    _, runs = expand(path)
    fed = [r.scenario.federation for r in runs]
    assert [(f.num_clients, f.clients_per_round, f.rounds, f.batch_size) for f in fed] == [(20, 10, 1, 2), (4, 2, 1, 3)]


def test_values_with_odd_names_and_keys_still_make_run_names(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(BASE.format(base=REPO / "scenarios/quickstart.yaml")
                    + "sweep:\n  defenses: [[], [{name: norm_clipping, delta: 1.0}]]\n  seed: [0, 1]\n")
    name, runs = expand(path)
    assert len(runs) == 4 and len({r.name for r in runs}) == 4
    from fedsim.runs.sweep import _token

    assert _token({"name": 3, 7: "x"}) == "3-7x" and _token({1: {2: 3}})


@pytest.mark.parametrize("base,needle", [("[null, {a: 1}]", "a path to the scenario"), ("x" * 5000, "cannot read")])
def test_a_base_that_is_not_a_readable_path_is_refused(tmp_path, capsys, base, needle):
    """Found by the slow fuzzing step: a `base:` list (or a name too long for the file system)
    escaped as OSError: File name too long."""
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {base}\nsweep:\n  seed: [0, 1]\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err) < 3000


def test_a_case_axis_sets_several_keys_at_once(tmp_path):
    quickstart = Path(__file__).resolve().parents[1] / "scenarios" / "quickstart.yaml"
    (tmp_path / "s.yaml").write_text(
        f"base: {quickstart}\nname: cases\nfederation: {{rounds: 2}}\nsweep:\n"
        "  defense:\n"
        "    - {label: none, aggregator: fedavg, defenses: []}\n"
        "    - {label: flame-krum, aggregator: {name: krum, num_malicious: 1}, defenses: [flame]}\n"
        "  seed: [1, 2]\n")
    name, runs = expand(tmp_path / "s.yaml")
    assert [r.name for r in runs] == ["defense_none__seed_1", "defense_none__seed_2",
                                      "defense_flame-krum__seed_1", "defense_flame-krum__seed_2"]
    krum = runs[2].scenario
    assert krum.aggregator.name == "krum" and [d.name for d in krum.defenses] == ["flame"] and krum.seed == 1
    assert runs[0].scenario.aggregator.name == "fedavg" and runs[0].scenario.defenses == []


def test_a_case_axis_needs_mappings(tmp_path, capsys):
    quickstart = Path(__file__).resolve().parents[1] / "scenarios" / "quickstart.yaml"
    (tmp_path / "s.yaml").write_text(f"base: {quickstart}\nsweep:\n  defense: [fedavg, krum]\n")
    assert main(["validate", str(tmp_path / "s.yaml")]) != 0
    assert "each of its values must be a mapping of scenario keys" in capsys.readouterr().err


def test_only_runs_a_slice_of_the_grid_in_the_full_grids_folders(tmp_path, capsys):
    quickstart = Path(__file__).resolve().parents[1] / "scenarios" / "quickstart.yaml"
    (tmp_path / "s.yaml").write_text(
        f"base: {quickstart}\nname: cases\nfederation: {{rounds: 2}}\nsweep:\n"
        "  defense:\n"
        "    - {label: none, aggregator: fedavg, defenses: []}\n"
        "    - {label: flame, aggregator: fedavg, defenses: [flame]}\n"
        "    - {label: krum, aggregator: {name: krum, num_malicious: 1}}\n"
        "  seed: [1, 2]\n")
    from fedsim.runs.sweep import Grid

    grid = Grid.read(tmp_path / "s.yaml")
    full = [r.name for r in grid.validated()]
    cut = [r.name for r in grid.only(["defense=krum,none", "seed=2"]).validated()]
    assert cut == ["defense_none__seed_2", "defense_krum__seed_2"] and set(cut) <= set(full)
    for bad, needle in [("defense=median", "no such value; the swept values are ['none', 'flame', 'krum']"),
                        ("attack=none", "one of the swept keys ['defense', 'seed']"), ("defense", "AXIS=LABEL")]:
        assert main(["sweep", str(tmp_path / "s.yaml"), "--only", bad]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err
