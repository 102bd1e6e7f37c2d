"""How close a reconstruction is to the data it came from: PSNR, SSIM, label accuracy, image grids.

The harness (fedsim/server/leakage.py) alone holds the clients' true data; it calls `score` with a
`Reconstruction` and the attacked clients' examples, and `save_grid` for the run folder's picture.

- **Matching.** An attack returns its reconstructions in no particular order (a batch's gradient
  is a sum: permutation invariant), and a client may hold more examples than the attack
  reconstructed. `match` pairs each reconstruction with a distinct true example so that the total
  PSNR is largest (the Hungarian algorithm, `scipy.optimize.linear_sum_assignment`), the way
  breaching orders a reconstructed batch before scoring it (`breaching/analysis/analysis.py`,
  `compute_batch_order`, which uses LPIPS where fedsim uses PSNR: no pretrained network is needed
  or downloaded). With m reconstructions and n true examples it gives min(m, n) pairs.
- **PSNR** per image: 10·log10(R² / MSE) with R = bounds[1] − bounds[0], the dataset's input range
  (torchmetrics' `peak_signal_noise_ratio`, `data_range=R`, the MSE over all of an example's
  values). Identical images give +inf, as in torchmetrics and the official Inverting Gradients
  code (`inversefed/metrics.py`, `psnr`).
- **SSIM** per image (Wang et al., IEEE TIP 2004): torchmetrics' `structural_similarity_index_measure`
  with its (and the paper's) Gaussian window of 11x11, σ = 1.5, K1 = 0.01, K2 = 0.03, L = R. Note
  torchmetrics' convention: the image is reflection-padded by 5 and the SSIM map (one value per
  pixel and channel) is averaged over the whole padded-back image, not only over the windows that
  fit inside it. SSIM is defined here for image-shaped examples only: three dimensions per example
  (C, H, W) with H, W ≥ 7 (skimage's smallest default window; torchmetrics' padding needs > 5).
  Otherwise (tabular rows, text, 1-D signals) `ssim` returns None and `score` reports None.
- **Label accuracy**: the share of matched pairs whose reconstructed label equals the true
  example's label (None when the attack inferred no labels).

torchmetrics, scipy and matplotlib are imported inside the functions (a device ClientApp loads
this package with the registries and has none of them).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fedsim.leakage.base import Reconstruction

SSIM_MIN_SIDE = 7  # smallest H, W at which `ssim` is defined (see the module docstring)


def _range(bounds: tuple[float, float]) -> float:
    lo, hi = float(bounds[0]), float(bounds[1])
    if not hi > lo:
        raise ValueError(f"bounds {bounds}: the upper bound must exceed the lower one")
    return hi - lo


def _pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if a.shape != b.shape:
        raise ValueError(f"the images to compare differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.ndim < 2:
        raise ValueError(f"expected a batch [m, ...] of examples, got shape {tuple(a.shape)}")
    return a.detach().float().cpu(), b.detach().float().cpu()


PSNR_CAP = 1000.0  # dB given to an identical copy where a finite number is needed (matching, scores)


def psnr(a: torch.Tensor, b: torch.Tensor, bounds: tuple[float, float]) -> torch.Tensor:
    """PSNR in dB of each example of `a` against the same row of `b` ([m, ...] both): `[m]`, with the
    data range bounds[1] − bounds[0]; +inf where they are identical."""
    from torchmetrics.functional.image import peak_signal_noise_ratio

    a, b = _pair(a, b)
    if len(a) == 0:
        return torch.zeros(0)
    return peak_signal_noise_ratio(a, b, data_range=_range(bounds), reduction="none", dim=tuple(range(1, a.ndim)))


def is_image(shape: tuple[int, ...]) -> bool:
    """Whether examples of this shape ([C, H, W]) get an SSIM."""
    return len(shape) == 3 and min(shape[1], shape[2]) >= SSIM_MIN_SIDE


def ssim(a: torch.Tensor, b: torch.Tensor, bounds: tuple[float, float]) -> torch.Tensor | None:
    """SSIM of each example of `a` against the same row of `b` ([m, C, H, W] both): `[m]`, or None
    when the examples are not images (see `is_image`)."""
    a, b = _pair(a, b)
    if not is_image(tuple(a.shape[1:])):
        return None
    if len(a) == 0:
        return torch.zeros(0)
    from torchmetrics.functional.image import structural_similarity_index_measure

    return structural_similarity_index_measure(a, b, gaussian_kernel=True, sigma=1.5, kernel_size=11,
                                               data_range=_range(bounds), k1=0.01, k2=0.03, reduction="none")


def psnr_matrix(recon: torch.Tensor, truth: torch.Tensor, bounds: tuple[float, float]) -> torch.Tensor:
    """`[m, n]` PSNR (dB, float64) of every reconstruction against every true example; a perfect
    match is capped at a finite 1000 dB so that the assignment stays well defined."""
    r = recon.detach().double().cpu().reshape(len(recon), -1)
    t = truth.detach().double().cpu().reshape(len(truth), -1)
    if r.shape[1] != t.shape[1]:
        raise ValueError(f"reconstructions of shape {tuple(recon.shape[1:])} cannot match examples of shape "
                         f"{tuple(truth.shape[1:])}")
    mse = ((r * r).sum(1, keepdim=True) - 2 * r @ t.T + (t * t).sum(1)).clamp_min(0) / r.shape[1]
    return (10 * torch.log10(_range(bounds) ** 2 / mse)).clamp(max=PSNR_CAP)


def match(recon: torch.Tensor, truth: torch.Tensor, bounds: tuple[float, float]) -> tuple[list[int], list[int]]:
    """Pair each reconstruction with a distinct true example, maximising the total PSNR: (rows,
    cols), reconstruction `rows[k]` with true example `cols[k]`, min(m, n) pairs, rows ascending."""
    from scipy.optimize import linear_sum_assignment

    if len(recon) == 0 or len(truth) == 0:
        return [], []
    rows, cols = linear_sum_assignment(psnr_matrix(recon, truth, bounds).numpy(), maximize=True)
    return [int(i) for i in rows], [int(j) for j in cols]


def score(rec: Reconstruction, truth_x: torch.Tensor, truth_y: torch.Tensor | None,
          bounds: tuple[float, float]) -> dict:
    """A reconstruction scored against the true examples it came from (see the module docstring):
    images, psnr_mean, psnr_max (each pair's PSNR capped at PSNR_CAP), ssim_mean (None: not
    images), label_accuracy (None: no labels), pairs [(reconstruction index, true index)]."""
    inputs = rec.inputs.detach().cpu()
    rows, cols = match(inputs, truth_x, bounds)
    out: dict = {"images": len(inputs), "psnr_mean": None, "psnr_max": None, "ssim_mean": None,
                 "label_accuracy": None, "pairs": list(zip(rows, cols))}
    if not rows:
        return out
    r, t = inputs[rows], truth_x.detach().cpu()[cols]
    p = psnr(r, t, bounds).clamp(max=PSNR_CAP)  # an identical copy: the cap, not +inf (JSON has no infinity)
    out["psnr_mean"], out["psnr_max"] = float(p.mean()), float(p.max())
    s = ssim(r, t, bounds)
    out["ssim_mean"] = None if s is None else float(s.mean())
    if rec.labels is not None and truth_y is not None:
        got = rec.labels.detach().cpu().long()[rows]
        out["label_accuracy"] = float((got == truth_y.detach().cpu().long()[cols]).float().mean())
    return out


def _as_picture(x: torch.Tensor, bounds: tuple[float, float]):
    """One example as what imshow draws: [H, W] grayscale (one channel, or the channels' mean when
    there are neither 1 nor 3), [H, W, 3] RGB, scaled to [0, 1]; a vector is drawn as a 1-row strip."""
    x = ((x.detach().float().cpu() - bounds[0]) / _range(bounds)).clamp(0, 1)
    if x.ndim == 1:
        x = x[None, None]
    elif x.ndim == 2:
        x = x[None]
    elif x.ndim > 3:
        x = x.reshape(x.shape[0], x.shape[1], -1)
    if x.shape[0] == 3:
        return x.permute(1, 2, 0).numpy()
    return x.mean(0).numpy()


def save_grid(path, truth: torch.Tensor, recon: torch.Tensor, pairs: list[tuple[int, int]],
              bounds: tuple[float, float], max_images: int = 8) -> Path:
    """A PNG of the first `max_images` matched pairs: the true inputs on top, their reconstructions
    below (grayscale or RGB by channel count), each reconstruction titled with its PSNR. Drawn
    with matplotlib's Agg canvas (no display, no global backend switch). Returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    pairs = list(pairs)[: max(int(max_images), 0)]
    k = max(len(pairs), 1)
    fig = Figure(figsize=(1.2 * k, 2.6), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, k, squeeze=False)
    for ax in axes.ravel():
        ax.set_axis_off()
    if pairs:
        rows = [r for r, _ in pairs]
        cols = [c for _, c in pairs]
        values = psnr(recon[rows], truth[cols], bounds)
        for j, (r, c) in enumerate(pairs):
            for ax, x in ((axes[0, j], truth[c]), (axes[1, j], recon[r])):
                picture = _as_picture(x, bounds)
                ax.imshow(picture, cmap=None if picture.ndim == 3 else "gray", vmin=0, vmax=1, interpolation="nearest")
            axes[0, j].set_title(f"example {c}", fontsize=7)
            axes[1, j].set_title(f"{float(values[j]):.1f} dB", fontsize=7)
    fig.suptitle("top: true inputs; bottom: reconstructions (PSNR)", fontsize=7)
    fig.savefig(path, format="png")
    return path
