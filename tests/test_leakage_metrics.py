"""Reconstruction metrics (issue #36, leakage/metrics.py): PSNR by hand, SSIM against a brute-force
Wang et al. SSIM written here, the matching against brute force over assignments, the scores of a
constructed reconstruction, and the image grid as a real PNG."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fedsim.leakage.base import Reconstruction
from fedsim.leakage.metrics import PSNR_CAP, is_image, match, psnr, psnr_matrix, save_grid, score, ssim


def test_psnr_of_a_known_mse_by_hand():
    a = torch.zeros(3, 1, 4, 4)
    b = torch.stack([torch.full((1, 4, 4), 0.1), torch.full((1, 4, 4), 0.2), torch.zeros(1, 4, 4)])
    b[1, 0, 0, 0] = 0.0  # one pixel right: MSE = 15 * 0.04 / 16
    got = psnr(b, a, (0.0, 1.0))
    assert got[0].item() == pytest.approx(20.0, abs=1e-4)  # 10 log10(1 / 0.01)
    assert got[1].item() == pytest.approx(10 * math.log10(1 / (15 * 0.04 / 16)), abs=1e-4)
    assert math.isinf(got[2].item())  # identical
    # the data range is the bounds' width: [-1, 1] has peak 2
    assert psnr(b[:1], a[:1], (-1.0, 1.0)).item() == pytest.approx(10 * math.log10(4 / 0.01), abs=1e-4)
    # tabular rows: the MSE over the row
    assert psnr(torch.tensor([[0.0, 0.5]]), torch.zeros(1, 2), (0.0, 1.0)).item() == pytest.approx(
        10 * math.log10(1 / 0.125), abs=1e-4)


def brute_ssim(x: torch.Tensor, y: torch.Tensor, data_range: float) -> float:
    """SSIM of one image pair [C, H, W] by the Wang et al. (2004) formula, pixel by pixel: an 11x11
    Gaussian window (σ 1.5) normalised to sum 1, K1 = 0.01, K2 = 0.03, the local means, variances
    and covariance of each window, averaged over every pixel and channel. Border windows reach
    outside the image through reflection (index −i ↦ i, H−1+i ↦ H−1−i), the convention of the
    library fedsim calls (torchmetrics)."""
    x, y = x.double(), y.double()
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    half = 5
    g = [math.exp(-(k * k) / (2 * 1.5**2)) for k in range(-half, half + 1)]
    total = sum(a * b for a in g for b in g)
    C, H, W = x.shape

    def reflect(i, n):
        return -i if i < 0 else (2 * (n - 1) - i if i >= n else i)

    values = []
    for c in range(C):
        for i in range(H):
            for j in range(W):
                mx = my = sxx = syy = sxy = 0.0
                for di in range(-half, half + 1):
                    for dj in range(-half, half + 1):
                        w = g[di + half] * g[dj + half] / total
                        a = float(x[c, reflect(i + di, H), reflect(j + dj, W)])
                        b = float(y[c, reflect(i + di, H), reflect(j + dj, W)])
                        mx += w * a
                        my += w * b
                        sxx += w * a * a
                        syy += w * b * b
                        sxy += w * a * b
                vx, vy, cov = max(sxx - mx * mx, 0.0), max(syy - my * my, 0.0), sxy - mx * my
                values.append((2 * mx * my + c1) * (2 * cov + c2) / ((mx * mx + my * my + c1) * (vx + vy + c2)))
    return sum(values) / len(values)


def test_ssim_is_one_on_identical_images_and_matches_a_brute_force_wang_ssim():
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(2, 1, 8, 8, generator=gen)
    assert torch.allclose(ssim(a, a, (0.0, 1.0)), torch.ones(2), atol=1e-6)
    for shape, bounds in (((2, 1, 8, 8), (0.0, 1.0)), ((1, 3, 9, 7), (-1.0, 1.0))):
        x = torch.rand(shape, generator=gen) * (bounds[1] - bounds[0]) + bounds[0]
        y = (x + 0.3 * torch.randn(shape, generator=gen)).clamp(*bounds)
        got = ssim(x, y, bounds)
        want = [brute_ssim(x[i], y[i], bounds[1] - bounds[0]) for i in range(shape[0])]
        assert got.tolist() == pytest.approx(want, abs=1e-5)
        assert max(want) < 0.99  # the pairs really differ


def test_ssim_is_none_for_examples_that_are_not_images():
    assert ssim(torch.rand(3, 10), torch.rand(3, 10), (0.0, 1.0)) is None
    assert ssim(torch.rand(3, 1, 5, 8), torch.rand(3, 1, 5, 8), (0.0, 1.0)) is None
    assert is_image((1, 8, 8)) and is_image((3, 32, 32)) and not is_image((1, 6, 8)) and not is_image((8, 8))


def test_matching_maximises_total_psnr_like_brute_force():
    gen = torch.Generator().manual_seed(1)
    for trial in range(5):
        truth = torch.rand(4, 1, 3, 3, generator=gen)
        recon = (truth[torch.randperm(4, generator=gen)] + 0.4 * torch.randn(4, 1, 3, 3, generator=gen)).clamp(0, 1)
        p = psnr_matrix(recon, truth, (0.0, 1.0))
        best = max(itertools.permutations(range(4)), key=lambda perm: sum(p[i, perm[i]].item() for i in range(4)))
        rows, cols = match(recon, truth, (0.0, 1.0))
        assert rows == [0, 1, 2, 3] and tuple(cols) == best
        # the matrix is the per-pair PSNR
        assert p[1, 2].item() == pytest.approx(psnr(recon[1:2], truth[2:3], (0.0, 1.0)).item(), abs=1e-4)
    # fewer reconstructions than examples: the best injective map; more: only as many pairs as examples
    truth = torch.rand(5, 4, generator=gen)
    recon = truth[[3, 0, 4]] + 0.05 * torch.randn(3, 4, generator=gen)
    p = psnr_matrix(recon, truth, (0.0, 1.0))
    best = max(itertools.permutations(range(5), 3), key=lambda c: sum(p[i, c[i]].item() for i in range(3)))
    assert match(recon, truth, (0.0, 1.0)) == ([0, 1, 2], list(best)) and list(best) == [3, 0, 4]
    rows, cols = match(truth, recon, (0.0, 1.0))
    assert len(rows) == 3 and sorted(cols) == [0, 1, 2] and [rows[cols.index(k)] for k in range(3)] == [3, 0, 4]


def test_score_of_a_constructed_reconstruction():
    gen = torch.Generator().manual_seed(2)
    truth = torch.rand(6, 1, 8, 8, generator=gen)
    labels = torch.tensor([0, 1, 2, 3, 4, 5])
    picked = [4, 1, 5]
    noise = torch.tensor([0.0, 0.1, 0.2]).view(3, 1, 1, 1)
    recon = truth[picked] + noise  # MSE 0, 0.01, 0.04 -> PSNR inf, 20, 13.98
    rec = Reconstruction(inputs=recon, labels=torch.tensor([4, 1, 0]))
    out = score(rec, truth, labels, (0.0, 1.0))
    assert out["images"] == 3 and out["pairs"] == [(0, 4), (1, 1), (2, 5)]
    assert out["label_accuracy"] == pytest.approx(2 / 3)
    assert out["psnr_max"] == PSNR_CAP  # the identical copy: the finite cap, not +inf
    assert out["psnr_mean"] == pytest.approx((PSNR_CAP + 20 + 10 * math.log10(1 / 0.04)) / 3, rel=1e-5)
    assert 0 < out["ssim_mean"] <= 1
    finite = score(Reconstruction(inputs=recon[1:]), truth, labels, (0.0, 1.0))
    assert finite["psnr_mean"] == pytest.approx((20 + 10 * math.log10(25)) / 2, abs=1e-3)
    assert finite["label_accuracy"] is None
    rows = torch.tensor([[0.0] * 5, [1.0] * 5, [0.5] * 5])  # tabular: no SSIM
    tab = score(Reconstruction(inputs=rows[[2, 0]] + 0.01, labels=torch.tensor([1, 1])), rows,
                torch.tensor([1, 0, 1]), (0.0, 1.0))
    assert tab["ssim_mean"] is None and tab["label_accuracy"] == 1.0 and tab["pairs"] == [(0, 2), (1, 0)]


@pytest.mark.parametrize("channels", [1, 3])
def test_save_grid_writes_a_decodable_png(tmp_path, channels):
    from PIL import Image

    gen = torch.Generator().manual_seed(3)
    truth = torch.rand(5, channels, 8, 8, generator=gen)
    recon = truth[[2, 0, 4]] * 0.9
    out = save_grid(tmp_path / "grid.png", truth, recon, [(0, 2), (1, 0), (2, 4)], (0.0, 1.0), max_images=2)
    assert out == tmp_path / "grid.png"
    with Image.open(out) as img:
        img.verify()
    with Image.open(out) as img:
        assert img.format == "PNG" and img.size[0] > 50 and img.size[1] > 50
