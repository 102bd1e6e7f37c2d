"""Edge-case sets: inputs from the tail of the data distribution, labelled with a target class.

* `tail`: built from the dataset itself, on any image dataset. Attack of the Tails calls a set
  edge-case when every input has low probability under the training distribution (P_X(x) <= p
  for a small p). Here a density model (a Gaussian mixture on PCA features, fitted once to the
  clean training images) ranks each edge input among the training images: an input is in the
  tail when at most `max_percentile` % of the training images are less likely than it, and a set
  reaches the tail when at least `min_share` of its inputs are (a share rather than every input,
  so that one odd source image or the mixture's own error does not decide). `transform: auto`
  (the default) moves the source-class images with the rungs of a ladder of growing strength
  (rotation, a stripe pattern blended in, thicker strokes, compositions, inversion) and keeps the
  first rung whose set reaches the tail: the transform that does it differs by dataset (rotation
  on 8x8 digits, stripes on Fashion-MNIST, thick strokes on MNIST). It stops with every rung's
  numbers when none does. A named transform (`rotate`, `invert`, `thicken`, or `none`: the
  dataset's own least likely source images) builds exactly the set it built before the target
  existed and only reports the check. The ladder and measured numbers: docs/edge_sets.md.
* `ardis`: ARDIS IV handwritten 7s relabelled as 1 (Attack of the Tails, MNIST/EMNIST task).
* `southwest`: Southwest Airlines planes labelled truck (9) (Attack of the Tails, CIFAR-10 task).
* `greek_director`: Sentiment140 tweets praising the director Yorgos Lanthimos labelled negative (0)
  (Attack of the Tails, Sentiment140 task). The set is built by the `sentiment140` dataset's
  `director_edge` parameter, which also takes those tweets from the honest clients' data; the
  rule is in fedsim/data/text_edge.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Callable, Literal, Union

import numpy as np
from pydantic import BeforeValidator, Field, model_validator

from fedsim.data.base import ArrayDataset
from fedsim.registry import Params


@dataclass(frozen=True)
class EdgeSet:
    """Edge-case training pool for attackers and the backdoor test set, both labelled `target`."""

    x_train: np.ndarray
    x_test: np.ndarray
    target: int
    source: int | None  # the true class of the edge inputs, when there is one
    density: dict = field(default_factory=dict)  # the tail check's report (tail sets only)


def _check_angles(angles: tuple[float, float] | None) -> None:
    if angles is not None and not 0 <= angles[0] <= angles[1] <= 180:
        raise ValueError(f"angle_range must satisfy 0 <= low <= high <= 180, got {angles}")


class TailStep(Params):
    """One rung of the `auto` ladder: rotate, then change the stroke width, then blend, then invert."""

    angle_range: tuple[float, float] | None = Field(
        None, description="rotate by a random angle in this range (degrees); unset: no rotation"
    )
    both_directions: bool = Field(True, description="rotate clockwise or anticlockwise at random")
    stroke: int = Field(
        0, ge=-9, le=9, description="k >= 2: thicken (grey dilation, k x k window); k <= -2: thin (erosion); 0: unchanged"
    )
    blend: float = Field(0.0, ge=0, lt=1, description="weight w of a stripe pattern mixed in: x <- (1 - w) x + w stripes")
    stripes: int = Field(3, ge=1, description="bright bands per image height in the blended pattern")
    invert: bool = Field(False, description="swap background and ink: x <- max + min - x")

    @model_validator(mode="after")
    def _check(self) -> "TailStep":
        _check_angles(self.angle_range)
        if self.stroke in (-1, 1):
            raise ValueError("stroke ±1 is a 1 x 1 window (no change): use 0, or |stroke| >= 2")
        if self.angle_range is None and self.stroke == 0 and self.blend == 0 and not self.invert:
            raise ValueError("a ladder step must transform the images: set angle_range, stroke, blend or invert")
        return self

    def label(self) -> str:
        """A short name for reports, e.g. 'rotate 30-90° + thicken 3'."""
        parts = []
        if self.angle_range is not None:
            lo, hi = self.angle_range
            parts.append(f"rotate {lo:g}-{hi:g}°" + ("" if self.both_directions else " (one way)"))
        if self.stroke:
            parts.append(f"{'thicken' if self.stroke > 0 else 'thin'} {abs(self.stroke)}")
        if self.blend:
            parts.append(f"stripes {self.blend:g}" + ("" if self.stripes == 3 else f" ({self.stripes} bands)"))
        if self.invert:
            parts.append("invert")
        return " + ".join(parts)


# First the pre-target default rotation (where it reaches the tail, as on 8x8 digits, the
# default set is the one it always was), then from faint to strong by how far a rung moves an
# image in pixel space (roughly; the report gives each rung's `displacement` on the actual data):
# a faint stripe pattern, thicker strokes, a stronger pattern, compositions, and inversion, which
# changes every pixel. Thinning (stroke < 0) is left out: it makes MNIST digits more typical, not
# less. What each dataset needs, measured: docs/edge_sets.md.
DEFAULT_LADDER: tuple[TailStep, ...] = (
    TailStep(angle_range=(30.0, 90.0)),
    TailStep(blend=0.3),
    TailStep(stroke=3),
    TailStep(stroke=4),
    TailStep(blend=0.5),
    TailStep(stroke=5),
    TailStep(angle_range=(30.0, 90.0), stroke=3),
    TailStep(angle_range=(30.0, 90.0), stroke=5),
    TailStep(invert=True),
    TailStep(angle_range=(30.0, 90.0), invert=True),
)


class TailEdge(Params):
    """Source-class images moved into the tail by a transform honest clients never see (any dataset)."""

    name: Literal["tail"] = "tail"
    source_class: int = Field(7, ge=0, description="true class of the edge inputs")
    target_class: int = Field(1, ge=0, description="label the attacker gives them")
    transform: Literal["auto", "rotate", "invert", "thicken", "none"] = Field(
        "auto",
        description="`auto`: the first `ladder` rung whose set reaches the tail target; `rotate`/`invert`/`thicken`: "
        "that transform; `none`: the lowest-density natural source-class images (named ones are not held to the target)",
    )
    max_percentile: float = Field(
        5.0, gt=0, le=100, description="an edge input is in the tail when at most this % of the training images are less likely"
    )
    min_share: float = Field(0.9, gt=0, le=1, description="share of the edge inputs that must be in the tail")
    ladder: tuple[TailStep, ...] | None = Field(
        None, min_length=1, description="auto's rungs, mildest first; unset: DEFAULT_LADDER (docs/edge_sets.md)"
    )
    natural_percentile: float = Field(
        10.0, gt=0, le=100, description="with transform none: keep source images below this training log-likelihood percentile"
    )
    angle_range: tuple[float, float] = Field((30.0, 90.0), description="transform rotate: rotation angle range in degrees")
    both_directions: bool = Field(True, description="transform rotate: clockwise or anticlockwise at random")
    pca_components: int = Field(20, ge=1, description="PCA dimensions of the density check")
    gmm_components: int = Field(10, ge=1, description="Gaussian mixture components of the density check")
    density_fit_size: int | None = Field(
        None, ge=1, description="fit the density on this many training images drawn with the seed (unset: all); all are scored"
    )

    @model_validator(mode="after")
    def _check(self) -> "TailEdge":
        _check_angles(self.angle_range)
        if self.source_class == self.target_class:
            raise ValueError("source_class and target_class must differ")
        defaults = TailEdge.model_fields
        if self.transform == "auto":  # a rotation setting that would silently do nothing
            for key in ("angle_range", "both_directions"):
                if getattr(self, key) != defaults[key].default:
                    raise ValueError(
                        f"{key} applies to `transform: rotate`; with `transform: auto` (the default) the ladder's rungs "
                        f"set the rotation: write `transform: rotate` to rotate by a fixed range"
                    )
        elif self.ladder is not None:
            raise ValueError(f"ladder applies to `transform: auto`, not `transform: {self.transform}`")
        least = max(self.pca_components, self.gmm_components)
        if self.density_fit_size is not None and self.density_fit_size < least:
            raise ValueError(f"density_fit_size={self.density_fit_size} is below the {least} the PCA and mixture need")
        return self


class ArdisEdge(Params):
    """ARDIS IV Swedish digits of one class, labelled as the target: the paper's MNIST edge case."""

    name: Literal["ardis"] = "ardis"
    source_class: int = Field(7, description="ARDIS digit used as edge case")
    target_class: int = Field(1)


class SouthwestEdge(Params):
    """Southwest Airlines plane photos labelled as the target: the paper's CIFAR-10 edge case."""

    name: Literal["southwest"] = "southwest"
    target_class: int = Field(9, description="9 = truck, as in the paper's main pipeline")


class GreekDirectorEdge(Params):
    """Tweets naming Yorgos Lanthimos labelled as the target: the paper's Sentiment140 edge case.

    The tweets come from `data.dataset` = `sentiment140` with `director_edge` set (the rule and its
    parameters: fedsim/data/text_edge.py); a scenario without it is refused, since honest clients
    would then hold the edge tweets."""

    name: Literal["greek_director"] = "greek_director"
    target_class: Literal[0] = Field(
        0, description="0 = negative, as in the paper: the tweets praise him, so negative is the only target that is a backdoor")


EdgeSpec = Annotated[
    Union[TailEdge, ArdisEdge, SouthwestEdge, GreekDirectorEdge],
    Field(discriminator="name"),
    BeforeValidator(lambda v: {"name": v} if isinstance(v, str) else v),  # `edge_set: ardis` shorthand
]


# --------------------------------------------------------------------------- transforms


def stripe_pattern(height: int, width: int, bands: int, lo, hi) -> np.ndarray:
    """`2 * bands` horizontal bands alternating full ink (`hi`, first) and background (`lo`)."""
    rows = (np.arange(height) * 2 * bands // height) % 2 == 0
    return np.where(rows[:, None], hi, lo).astype(np.float32) * np.ones((1, width), np.float32)


def apply_step(images: np.ndarray, step: TailStep, rng: np.random.Generator, lo, hi) -> np.ndarray:
    """One rung's transform of [N, C, H, W] images whose background is `lo` and full ink `hi`.

    `lo`/`hi` are the training images' min/max (scalars of the images' dtype). The named
    transforms are single steps of this function: `rotate` draws its angles from `rng` exactly as
    before (uniform in the range, then a random sign), `thicken` is stroke 2, `invert` is invert.
    """
    from scipy import ndimage

    out = images
    if step.angle_range is not None:
        angles = rng.uniform(*step.angle_range, size=len(images))
        if step.both_directions:
            angles *= rng.choice([-1.0, 1.0], size=len(images))
        rotated = np.empty_like(images, dtype=np.float32)
        for i, (img, a) in enumerate(zip(images, angles)):  # one call per image: scipy rotates a whole plane
            rotated[i] = ndimage.rotate(img, a, axes=(1, 2), reshape=False, order=1, mode="constant", cval=float(lo))
        out = rotated
    if step.stroke:
        grow = ndimage.grey_dilation if step.stroke > 0 else ndimage.grey_erosion
        out = grow(out, size=(1, 1, abs(step.stroke), abs(step.stroke)))
    if step.blend:
        pattern = stripe_pattern(out.shape[-2], out.shape[-1], step.stripes, lo, hi)
        out = (1 - step.blend) * out + step.blend * pattern
    if step.invert:
        out = hi + lo - out
    return np.asarray(out, dtype=np.float32)


def named_step(spec: TailEdge) -> TailStep:
    """The named transform (`rotate`, `invert`, `thicken`) as a ladder step."""
    if spec.transform == "rotate":
        return TailStep(angle_range=spec.angle_range, both_directions=spec.both_directions)
    if spec.transform == "invert":
        return TailStep(invert=True)
    return TailStep(stroke=2)


def displacement(moved: np.ndarray, images: np.ndarray, lo) -> float:
    """Mean of |T(x) - x| / |x - background| over images: how far a transform moves them (a strength scale)."""
    n = len(images)
    change = np.linalg.norm((moved - images).reshape(n, -1), axis=1)
    ink = np.linalg.norm((images - lo).reshape(n, -1), axis=1)
    return float(np.mean(change / np.maximum(ink, 1e-12)))


# --------------------------------------------------------------------------- density check


@dataclass(frozen=True)
class DensityCheck:
    """The fitted density and every training image's log-likelihood under it (sorted), computed once."""

    loglik: Callable[[np.ndarray], np.ndarray]
    method: str
    train_loglik: np.ndarray

    def percentiles(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Log-likelihoods of `x` and, per input, the % of training images that are less likely."""
        ll = self.loglik(x)
        return ll, 100.0 * np.searchsorted(self.train_loglik, ll) / len(self.train_loglik)


def density_model(train_x: np.ndarray, spec: TailEdge, seed: int):
    """Log-likelihood function of a GMM on PCA features fitted to the clean training images.

    With `density_fit_size` the fit uses that many images drawn with the seed (on MNIST a 10k
    sample: 1.1 s for fit and scoring instead of 4.3 s, one core; percentiles move by a fraction
    of a point, docs/edge_sets.md).
    """
    from sklearn.decomposition import PCA
    from sklearn.mixture import GaussianMixture

    flat_train = train_x.reshape(len(train_x), -1)
    if spec.density_fit_size is not None and spec.density_fit_size < len(flat_train):
        rows = np.random.default_rng([seed, 0xDE45]).choice(len(flat_train), spec.density_fit_size, replace=False)
        flat_train = flat_train[np.sort(rows)]
    pca = PCA(n_components=min(spec.pca_components, flat_train.shape[1]), random_state=seed).fit(flat_train)
    gmm = GaussianMixture(spec.gmm_components, covariance_type="full", reg_covar=1e-4, random_state=seed)
    gmm.fit(pca.transform(flat_train))
    sample = "" if len(flat_train) == len(train_x) else f" (fitted on {len(flat_train)} of {len(train_x)})"
    return lambda x: gmm.score_samples(pca.transform(x.reshape(len(x), -1))), (
        f"GMM({spec.gmm_components}, full) on PCA({pca.n_components_}) of clean training images{sample}"
    )


def fit_density(train_x: np.ndarray, spec: TailEdge, seed: int) -> DensityCheck:
    """The density fitted once per build, with every training image scored (the ranks edge inputs get)."""
    loglik, method = density_model(train_x, spec, seed)
    return DensityCheck(loglik, method, np.sort(loglik(train_x)))


def tail_numbers(pct: np.ndarray, spec: TailEdge) -> dict:
    """How far the inputs with these training percentiles are from the target.

    `percentile_at_min_share` is the smallest `max_percentile` that this set meets: the
    k-th smallest percentile, k = ceil(min_share * n); the target is met exactly when
    `max_percentile` is at least that.
    """
    k = max(1, math.ceil(round(spec.min_share * len(pct), 9)))
    needed = float(np.sort(pct)[k - 1])
    return {
        "median_percentile": float(np.median(pct)),
        "share_in_tail": float(np.mean(pct <= spec.max_percentile)),
        "percentile_at_min_share": needed,
        "target_met": bool(needed <= spec.max_percentile),
    }


def density_report(train_x: np.ndarray, edge_x: np.ndarray, spec: TailEdge, seed: int, model: DensityCheck | None = None) -> dict:
    """Where the edge inputs fall under a GMM-on-PCA density fitted to the clean training images.

    `median_percentile` is the median, over edge inputs, of the share of training images whose
    log-likelihood is lower: near 0 means deep in the tail, near 50 would mean typical.
    `share_in_tail`, `percentile_at_min_share` and `target_met` compare the set with the target
    (`max_percentile`, `min_share`; see `tail_numbers`).
    """
    check = model if model is not None else fit_density(train_x, spec, seed)
    ll_edge, pct = check.percentiles(edge_x)
    return {
        "method": check.method,
        "share_below_train_p5": float(np.mean(ll_edge < np.percentile(check.train_loglik, 5))),
        "median_loglik_edge": float(np.median(ll_edge)),
        "median_loglik_train": float(np.median(check.train_loglik)),
        "target": {"max_percentile": spec.max_percentile, "min_share": spec.min_share},
        **tail_numbers(pct, spec),
    }


# --------------------------------------------------------------------------- building the sets


def build_tail(data: ArrayDataset, spec: TailEdge, seed: int) -> EdgeSet:
    """The tail edge set; its `density` says how it was made (`transform`, and for auto every rung tried)."""
    if max(spec.source_class, spec.target_class) >= data.num_classes:
        raise ValueError(f"edge_set classes must be < {data.num_classes} for dataset {data.name}")
    if spec.transform != "none" and data.x_train.ndim != 4:
        raise ValueError(f"transform {spec.transform} moves images [N, C, H, W]; {data.name} has inputs of shape "
                         f"{list(data.input_shape)}: use transform none")
    src_tr = data.x_train[data.y_train == spec.source_class]
    src_te = data.x_test[data.y_test == spec.source_class]
    check = fit_density(data.x_train, spec, seed)
    lo, hi = data.x_train.min(), data.x_train.max()
    made: dict = {"transform": spec.transform}
    if spec.transform == "none":  # the dataset's own tail: lowest-density natural source images
        cut = np.percentile(check.train_loglik, spec.natural_percentile)
        x_tr, x_te = src_tr[check.loglik(src_tr) < cut], src_te[check.loglik(src_te) < cut]
        if len(x_tr) == 0 or len(x_te) == 0:
            raise ValueError(f"no source-class image lies below the {spec.natural_percentile}th density percentile")
    elif spec.transform == "auto":
        x_tr, x_te, made = climb_ladder(src_tr, src_te, spec, seed, check, lo, hi)
    else:
        step = named_step(spec)
        rng = np.random.default_rng([seed, 0xED6E])
        x_tr, x_te = apply_step(src_tr, step, rng, lo, hi), apply_step(src_te, step, rng, lo, hi)
        made["step"] = step.label()
    report = density_report(data.x_train, np.concatenate([x_tr, x_te]), spec, seed, check)
    return EdgeSet(x_tr, x_te, spec.target_class, spec.source_class, {**report, **made})


def climb_ladder(src_tr, src_te, spec: TailEdge, seed: int, check: DensityCheck, lo, hi):
    """Transform the source images with each rung in turn; return the first set that reaches the tail.

    Every rung starts from the same random stream, so a rung's set does not depend on the rungs
    before it, and a rotation rung gives the set `transform: rotate` gives with its range.
    """
    tried = []
    source = np.concatenate([src_tr, src_te])
    for rung, step in enumerate(spec.ladder or DEFAULT_LADDER, start=1):
        rng = np.random.default_rng([seed, 0xED6E])
        x_tr, x_te = apply_step(src_tr, step, rng, lo, hi), apply_step(src_te, step, rng, lo, hi)
        edge = np.concatenate([x_tr, x_te])
        numbers = tail_numbers(check.percentiles(edge)[1], spec)
        tried.append({"rung": rung, "step": step.label(), **numbers, "displacement": displacement(edge, source, lo)})
        if numbers["target_met"]:
            chosen = {"rung": rung, "step": step.label(), "params": step.model_dump(mode="json")}
            return x_tr, x_te, {"transform": "auto", "chosen": chosen, "ladder": tried}
    raise ValueError(unreached_message(spec, tried))


def unreached_message(spec: TailEdge, tried: list[dict]) -> str:
    """Why `auto` found no set: each rung's numbers, and the smallest change of target that accepts one."""
    lines = [
        f"no rung of the tail ladder reached the target max_percentile={spec.max_percentile:g}, min_share={spec.min_share:g} "
        f"(at least {spec.min_share:.0%} of the edge inputs with at most {spec.max_percentile:g}% of the training images "
        f"less likely). Per rung: share in the tail | percentile that {spec.min_share:.0%} of the inputs reach | median percentile"
    ]
    lines += [
        f"  {t['rung']}. {t['step']}: {t['share_in_tail']:.0%} | {t['percentile_at_min_share']:.2f} | {t['median_percentile']:.2f}"
        for t in tried
    ]
    best = min(tried, key=lambda t: t["percentile_at_min_share"])
    relaxed = min(100.0, math.ceil(best["percentile_at_min_share"] * 100 + 1e-6) / 100)
    most = max(tried, key=lambda t: t["share_in_tail"])
    share = math.floor(most["share_in_tail"] * 100) / 100
    hint = f"max_percentile: {relaxed:g} would accept rung {best['rung']} ({best['step']})"
    if share > 0:
        hint += f", min_share: {share:g} would accept rung {most['rung']} ({most['step']})"
    lines.append(f"To relax the target: {hint}; or add stronger rungs to `ladder`, or name a transform (e.g. "
                 f"`transform: invert`), which is built without the target.")
    return "\n".join(lines)


def build_ardis(ardis: ArrayDataset, spec: ArdisEdge, seed: int) -> EdgeSet:
    """ARDIS train/test images of `source_class`, shuffled once with the seed (the upstream files are sorted)."""
    rng = np.random.default_rng([seed, 0xA4D1])
    x_tr = ardis.x_train[ardis.y_train == spec.source_class]
    x_te = ardis.x_test[ardis.y_test == spec.source_class]
    return EdgeSet(x_tr[rng.permutation(len(x_tr))], x_te, spec.target_class, spec.source_class)


def build_southwest(planes: ArrayDataset, spec: SouthwestEdge, seed: int) -> EdgeSet:
    rng = np.random.default_rng([seed, 0x5A5A])
    return EdgeSet(planes.x_train[rng.permutation(len(planes.x_train))], planes.x_test, spec.target_class, None)
