"""Edge-case sets: inputs from the tail of the data distribution, labelled with a target class.

* `tail`: built from the dataset itself (the foundation's method for digits, usable on any image
  dataset): take the source-class images and move them into the low-density tail with a
  transformation honest clients never see (rotation by a random angle in a range, colour
  inversion, or stroke thickening). A density model (Gaussian mixture on PCA features fitted on
  the clean training images) checks that the transformed images really are rare: the report gives
  their log-likelihood percentile under the training distribution.
* `ardis`: ARDIS IV handwritten 7s relabelled as 1 (Attack of the Tails, MNIST/EMNIST task).
* `southwest`: Southwest Airlines planes labelled truck (9) (Attack of the Tails, CIFAR-10 task).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal, Union

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


class TailEdge(Params):
    """Source-class images moved into the tail by a transform honest clients never see (any dataset)."""

    name: Literal["tail"] = "tail"
    source_class: int = Field(7, ge=0)
    target_class: int = Field(1, ge=0)
    transform: Literal["rotate", "invert", "thicken", "none"] = Field(
        "rotate", description="`none`: take the lowest-density natural source-class images instead"
    )
    natural_percentile: float = Field(
        10.0, gt=0, le=100, description="with transform none: keep source images below this training log-likelihood percentile"
    )
    angle_range: tuple[float, float] = Field((30.0, 90.0), description="rotation angle range in degrees")
    both_directions: bool = Field(True, description="rotate clockwise or anticlockwise at random")
    pca_components: int = Field(20, ge=1)
    gmm_components: int = Field(10, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "TailEdge":
        lo, hi = self.angle_range
        if not 0 <= lo <= hi <= 180:
            raise ValueError(f"angle_range must satisfy 0 <= low <= high <= 180, got {self.angle_range}")
        if self.source_class == self.target_class:
            raise ValueError("source_class and target_class must differ")
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


EdgeSpec = Annotated[
    Union[TailEdge, ArdisEdge, SouthwestEdge],
    Field(discriminator="name"),
    BeforeValidator(lambda v: {"name": v} if isinstance(v, str) else v),  # `edge_set: ardis` shorthand
]


def _transform(images: np.ndarray, spec: TailEdge, rng: np.random.Generator) -> np.ndarray:
    """Apply the tail transform to [N, C, H, W] images in [0, max] (per-image randomness from rng)."""
    from scipy import ndimage

    if spec.transform == "invert":
        lo, hi = images.min(), images.max()
        return (hi + lo - images).astype(np.float32)
    if spec.transform == "thicken":
        return ndimage.grey_dilation(images, size=(1, 1, 2, 2)).astype(np.float32)
    lo, hi = spec.angle_range
    angles = rng.uniform(lo, hi, size=len(images))
    if spec.both_directions:
        angles *= rng.choice([-1.0, 1.0], size=len(images))
    background = float(images.min())
    out = np.empty_like(images, dtype=np.float32)
    for i, (img, a) in enumerate(zip(images, angles)):  # one call per image: scipy rotates a whole plane
        out[i] = ndimage.rotate(img, a, axes=(1, 2), reshape=False, order=1, mode="constant", cval=background)
    return out


def density_model(train_x: np.ndarray, spec: TailEdge, seed: int):
    """Log-likelihood function of a GMM on PCA features fitted to the clean training images."""
    from sklearn.decomposition import PCA
    from sklearn.mixture import GaussianMixture

    flat_train = train_x.reshape(len(train_x), -1)
    pca = PCA(n_components=min(spec.pca_components, flat_train.shape[1]), random_state=seed).fit(flat_train)
    gmm = GaussianMixture(spec.gmm_components, covariance_type="full", reg_covar=1e-4, random_state=seed)
    gmm.fit(pca.transform(flat_train))
    return lambda x: gmm.score_samples(pca.transform(x.reshape(len(x), -1))), f"GMM({spec.gmm_components}, full) on PCA({pca.n_components_}) of clean training images"


def density_report(train_x: np.ndarray, edge_x: np.ndarray, spec: TailEdge, seed: int, model=None) -> dict:
    """Where the edge inputs fall under a GMM-on-PCA density fitted to the clean training images.

    `median_percentile` is the median, over edge inputs, of the share of training images whose
    log-likelihood is lower: near 0 means deep in the tail, near 50 would mean typical.
    """
    loglik, method = model if model is not None else density_model(train_x, spec, seed)
    ll_train = np.sort(loglik(train_x))
    ll_edge = loglik(edge_x)
    pct = 100.0 * np.searchsorted(ll_train, ll_edge) / len(ll_train)
    p5 = float(np.percentile(ll_train, 5))
    return {
        "method": method,
        "median_percentile": float(np.median(pct)),
        "share_below_train_p5": float(np.mean(ll_edge < p5)),
        "median_loglik_edge": float(np.median(ll_edge)),
        "median_loglik_train": float(np.median(ll_train)),
    }


def build_tail(data: ArrayDataset, spec: TailEdge, seed: int) -> EdgeSet:
    if max(spec.source_class, spec.target_class) >= data.num_classes:
        raise ValueError(f"edge_set classes must be < {data.num_classes} for dataset {data.name}")
    rng = np.random.default_rng([seed, 0xED6E])
    src_tr = data.x_train[data.y_train == spec.source_class]
    src_te = data.x_test[data.y_test == spec.source_class]
    model = density_model(data.x_train, spec, seed)
    if spec.transform == "none":  # the dataset's own tail: lowest-density natural source images
        cut = np.percentile(model[0](data.x_train), spec.natural_percentile)
        x_tr, x_te = src_tr[model[0](src_tr) < cut], src_te[model[0](src_te) < cut]
        if len(x_tr) == 0 or len(x_te) == 0:
            raise ValueError(f"no source-class image lies below the {spec.natural_percentile}th density percentile")
    else:
        x_tr, x_te = _transform(src_tr, spec, rng), _transform(src_te, spec, rng)
    report = density_report(data.x_train, np.concatenate([x_tr, x_te]), spec, seed, model)
    return EdgeSet(x_tr, x_te, spec.target_class, spec.source_class, report)


def build_ardis(ardis: ArrayDataset, spec: ArdisEdge, seed: int) -> EdgeSet:
    """ARDIS train/test images of `source_class`, shuffled once with the seed (the upstream files are sorted)."""
    rng = np.random.default_rng([seed, 0xA4D1])
    x_tr = ardis.x_train[ardis.y_train == spec.source_class]
    x_te = ardis.x_test[ardis.y_test == spec.source_class]
    return EdgeSet(x_tr[rng.permutation(len(x_tr))], x_te, spec.target_class, spec.source_class)


def build_southwest(planes: ArrayDataset, spec: SouthwestEdge, seed: int) -> EdgeSet:
    rng = np.random.default_rng([seed, 0x5A5A])
    return EdgeSet(planes.x_train[rng.permutation(len(planes.x_train))], planes.x_test, spec.target_class, None)
