"""Snowball: the bottom-up votes against a brute-force re-count (Calinski-Harabasz by its formula,
every voter's cluster), a constructed round whose colluding backdoor group is left out while the
top-down VAE election grows the honest selectees, and a real digits run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import quick_scenario, round_context, run_local
from fedsim.defenses.snowball import (VAE, Snowball, SnowballParams, layer_votes, pair_differences, reconstruction_errors,
                                      voter_clusters)
from fedsim.models.layout import ModelLayout
from fedsim.registry import DEFENSES
from fedsim.updates import UpdateBatch

pytestmark = pytest.mark.usefixtures("one_torch_thread")



def ch_by_formula(x: np.ndarray, labels: np.ndarray) -> float:
    """Calinski-Harabasz: (B / (k - 1)) / (W / (n - k)), between- and within-cluster dispersions."""
    n, ks = len(x), np.unique(labels)
    mean = x.mean(axis=0)
    b = sum((labels == k).sum() * np.sum((x[labels == k].mean(axis=0) - mean) ** 2) for k in ks)
    w = sum(np.sum((x[labels == k] - x[labels == k].mean(axis=0)) ** 2) for k in ks)
    return (b / (len(ks) - 1)) / (w / (n - len(ks)))


def test_bottom_up_votes_match_a_brute_force_recount():
    rng = np.random.default_rng(0)
    layer = np.concatenate([rng.normal(0, 0.1, (6, 5)), rng.normal(3, 0.1, (3, 5)), rng.normal(-4, 0.1, (1, 5))])
    members, scores = voter_clusters(layer, ct=2)
    from sklearn.cluster import KMeans

    raw = []
    for i in range(10):
        dif = layer[i] - layer
        far = np.argsort(np.linalg.norm(dif, axis=1), kind="stable")[-2:]
        lab = KMeans(3, init=dif[[i, *far]], n_init=1).fit_predict(dif)
        assert set(np.flatnonzero(lab == lab[i])) == set(members[i])
        raw.append(ch_by_formula(dif, lab))
    raw = np.array(raw)
    np.testing.assert_allclose(scores, raw, rtol=1e-9)
    # CH is translation invariant and every voter found the same three groups: equal scores, weight 1 each
    np.testing.assert_allclose(layer_votes(members, scores), [6] * 6 + [3] * 3 + [1])
    # unequal scores: min-max normalised weights, re-counted by brute force
    fake = np.array([5.0, 1.0, 3.0, 2.0, 4.0, 1.5, 0.0, 2.5, 6.0, 1.0])
    norm = (fake - fake.min()) / (fake.max() - fake.min())
    votes = np.zeros(10)
    for i in range(10):
        if fake[i] > 0:  # effective voters
            for j in members[i]:
                votes[j] += norm[i]
    np.testing.assert_allclose(layer_votes(members, fake), votes, rtol=1e-12)
    # the groups are the clusters: honest voters back the six honest updates
    assert all(set(members[i]) == set(range(6)) for i in range(6))


def test_pair_differences_are_all_ordered_pairs():
    rows = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    got = {tuple(r) for r in pair_differences(rows).tolist()}
    assert got == {tuple((rows[a] - rows[b]).tolist()) for a in range(3) for b in range(3) if a != b}


def test_batched_reconstruction_errors_match_the_official_per_candidate_loop():
    """The batched decoding draws the same latent samples in the official order (candidate by
    candidate, sample by sample) and averages the same errors; a candidate equal to every selectee
    (no non-zero difference) scores 0."""
    torch.manual_seed(0)
    vae = VAE(40, 4, 16)
    selected, candidates = torch.randn(3, 40), torch.randn(5, 40)
    candidates[1] = selected[0]
    lone = torch.randn(1, 40)

    def official(sel, cands, samples):
        out = []
        for r in cands:
            dif = sel - r[None, :]
            dif = dif[dif.sum(dim=1) != 0]
            if len(dif) == 0:
                out.append(torch.tensor(0.0))
                continue
            x = torch.sigmoid(torch.cat([dif, -dif]))
            mu, logvar = vae.encode(x)
            err = torch.zeros(len(x))
            for _ in range(samples):
                err += (vae.dec(mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)) - x).square().sum(dim=1)
            out.append((err / samples).mean())
        return torch.stack(out)

    for sel, cands in ((selected, candidates), (lone, lone)):
        torch.manual_seed(7)
        got = reconstruction_errors(vae, sel, cands, samples=6)
        torch.manual_seed(7)
        with torch.no_grad():
            want = official(sel, cands, 6)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert reconstruction_errors(vae, lone, lone, samples=2).tolist() == [0.0]


def backdoor_round(seed: int = 0):
    layout = ModelLayout(names=("0.weight", "0.bias", "2.weight", "2.bias"), shapes=((8, 6), (8,), (3, 8), (3,)))
    g = torch.Generator().manual_seed(seed)
    honest = 0.05 * torch.randn(1, layout.dim, generator=g) + 0.01 * torch.randn(7, layout.dim, generator=g)
    bad = 0.05 * torch.randn(1, layout.dim, generator=g) + 0.01 * torch.randn(3, layout.dim, generator=g)
    updates = torch.cat([honest, bad])
    return UpdateBatch(updates, torch.ones(10), tuple(range(10, 20))), round_context(layout=layout, global_weights=torch.zeros(layout.dim))


def test_colluding_group_is_left_out_and_the_selection_grows_to_half():
    batch, ctx = backdoor_round()
    out, log = Snowball(SnowballParams(ct=1)).before(batch, ctx)
    assert set(log["removed"]) >= {17, 18, 19}
    assert len(out.client_ids) == 5 and set(out.client_ids) <= set(range(10, 17))  # floor(0.5 · 10)
    assert len(log["elected"]) == 2 and set(log["elected"]) <= set(range(10, 17))
    assert [len(s) for s in log["top_down"]] == [1, 1, 1]  # ceil(0.05 · 10) a step
    # same round, same generator seed: same result
    _, again = Snowball(SnowballParams(ct=1)).before(batch, backdoor_round()[1])
    assert again == log


def test_registered_with_official_defaults():
    p = DEFENSES.get("snowball").params()
    assert (p.ct, p.vt, p.v_step, p.vae_hidden, p.vae_latent, p.vae_initial, p.vae_tuning) == (10, 0.5, 0.05, 256, 64, 270, 30)
    with pytest.raises(ValueError, match="vt"):
        DEFENSES.get("snowball").params(vt=0)


def test_digits_run_audit_reads_snowball_removals(tmp_path):
    scenario = quick_scenario(
        "aggregator=fedavg", "defenses=[{name: snowball, vae_initial: 10, vae_tuning: 2, vae_hidden: 32, vae_latent: 8}]",
        "attack={name: sign_flip, num_attackers: 1, schedule: {name: every_round, attackers_per_round: 1}}",
        federation={"num_clients": 8, "clients_per_round": 7, "rounds": 1, "local_epochs": 1},
    )
    (r,) = run_local(scenario, tmp_path).rounds
    info, det = r["defenses"]["snowball"], r["detection"]
    assert det["flagged"] == sorted(info["removed"]) and len(info["removed"]) == 7 - 3  # floor(0.5 · 7) kept
