"""Every robust rule and defense composes with a lossy codec with error feedback and with both kinds
of attack (a client-side edge-case backdoor with model replacement, a server-side Byzantine
attack): two real rounds each on the in-process grid, every round either aggregated or skipped
with a reason, the detection audit present. A combination that cannot work must be refused at
validation instead (tests/test_lowrank_rounds.py, tests/test_detox.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedsim.client.app import make_client_app
from fedsim.flower.local_grid import LocalGrid
from fedsim.registry import AGGREGATORS, DEFENSES
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.scenario import ScenarioError, load_scenario
from fedsim.server.app import run_server

ROOT = Path(__file__).resolve().parents[1]
BASE = ["federation.num_clients=12", "federation.clients_per_round=9", "federation.rounds=2", "federation.local_epochs=1",
        "compression={name: topk, fraction: 0.1}"]
ATTACKS = {
    "tails_pgd_replacement": ["attack.mode=pgd_replacement", "attack.schedule.every=1", "attack.schedule.first=1"],
    "alie": ["attack={name: alie, num_attackers: 3, schedule: {name: fixed_pool}}"],
}
# f = 1 wherever a rule takes f: 9 clients per round satisfy every rule's precondition
RULES = {
    "krum": "{name: krum, num_malicious: 1}", "multikrum": "{name: multikrum, num_malicious: 1}",
    "trimmed_mean": "{name: trimmed_mean, num_trim: 1}", "bulyan": "{name: bulyan, num_malicious: 1}",
    "detox": "{name: detox, group_size: 3, inner: {name: median}}",
    "bucketing": "{name: bucketing, s: 2, inner: {name: krum, num_malicious: 1}}",
    "nnm": "{name: nnm, num_malicious: 1, inner: median}", "dnc": "{name: dnc, num_malicious: 1}",
    "fltrust": "{name: fltrust, root_size: 50}",
}
DEFENSE_SPECS = {"fldetector": "{name: fldetector, window: 1}", "crfl": "{name: crfl, num_models: 5, certify_subset: 30}",
                 "deepsight": "{name: deepsight, num_samples: 100}", "snowball": "{name: snowball, vae_initial: 20, vae_tuning: 5}",
                 "fedgame": "{name: fedgame, nc_epochs: 5}"}
# defenses refused with a lossy codec (the reason named at validation): they compose with the attacks uncompressed
NO_LOSSY_CODEC = {"lockdown"}  # reads each client's sparse mask from its upload's non-zero coordinates
CASES = [("aggregator=" + RULES.get(name, name), name) for name in AGGREGATORS.names()
]
CASES += [(f"defenses=[{DEFENSE_SPECS.get(name, name)}]", name) for name in DEFENSES.names()]


@pytest.mark.parametrize("attack", sorted(ATTACKS))
@pytest.mark.parametrize("setting,name", CASES, ids=[name for _, name in CASES])
def test_every_rule_and_defense_composes_with_a_codec_and_the_attacks(tmp_path, setting, name, attack):
    base = BASE
    if name in NO_LOSSY_CODEC:
        with pytest.raises(ScenarioError, match="compression"):
            load_scenario(str(ROOT / "scenarios/quickstart.yaml"), BASE + ATTACKS[attack] + [setting])
        base = [b for b in BASE if not b.startswith("compression=")]
    scenario = load_scenario(str(ROOT / "scenarios/quickstart.yaml"), base + ATTACKS[attack] + [setting])
    run = RunFolder.create(scenario, tmp_path)
    run_server(LocalGrid(make_client_app(scenario), 12), scenario, run)
    lines = [r for r in read_rounds(run) if r["round"] > 0]
    assert len(lines) == 2
    for line in lines:
        assert line["skipped"] is None or isinstance(line["skipped"], str) and line["skipped"]
        assert "detection" in line or "valid updates" in str(line["skipped"])
