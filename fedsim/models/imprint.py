"""Robbing the Fed's imprint module: the malicious server's model (Fowl, Geiping, Czaja, Goldblum,
Goldstein, "Robbing the Fed: Directly Obtaining Private Data in Federated Learning with Modified
Models", ICLR 2022). The attack that reads it is `leakage/imprint.py`.

The server puts a block in front of an ordinary network (the `body`). The block is a linear layer
of k rows and a ReLU whose rows all take the same linear measurement m(x) = a·x of the flattened
input (its mean brightness, a random projection or one DCT coefficient), each with its own bias at
a quantile of that measurement's distribution:

    h_i(x) = ReLU(γ (z(x) − c_i)),   z(x) = (a·x − μ) / σ,   c_0 = −10,  c_i = F⁻¹(i / k)  (i ≥ 1)

so row i is active for the inputs whose standardised measurement exceeds c_i (the rows are
"cumulative": an input with c_j ≤ z < c_{j+1} activates rows 0..j). F is the standard normal CDF
(the Laplace of variance 1 for the DCT measurement, as the official code uses), μ and σ the
measurement's mean and standard deviation on the data, which the server is assumed to know (public
data from the same distribution), so that each bin [c_i, c_{i+1}) holds 1/k of the inputs. In the
weights: W_i = γ a / σ for every row, b_i = −γ (μ / σ + c_i).

Every row's output reaches the loss through the same coefficient (the block's output adds the
rows' mean to every input coordinate), so example n gives each active row the same gradient
g_n = ∂L/∂h: ∇W_i = Σ_{n: z_n ≥ c_i} g_n x_n and ∇b_i = Σ_{n: z_n ≥ c_i} g_n. Consecutive rows differ
by the inputs of one bin, and if exactly one input x fell in bin i,

    (∇W_i − ∇W_{i+1}) / (∇b_i − ∇b_{i+1}) = g x / g = x,

exactly, whatever g, whatever else the batch held and however many clients' gradients were
summed: secure aggregation does not hide it (the paper's §3-4; `leakage/imprint.py` reads it).

Official code: `JonasGeiping/breaching`, breaching/cases/malicious_modifications/imprint.py
(`ImprintBlock`: `_init_linear_function`, `_get_bins`, `_make_biases`, `forward`), placed by
breaching/cases/servers.py (`MaliciousModelServer._place_malicious_block`), configured by
breaching/config/case/server/malicious-model-rtf.yaml (64 bins, `linfunc: fourier`, `mode: 32`,
`connection: linear`, `gain: 1.0`). Its `linfunc` "avg" is `brightness` here, "randn" is `random`,
"fourier" is `fourier`.

Where fedsim differs, and why:
- The measurement is standardised by the `mean` and `std` given here. The official code assumes the
  measurement of its normalised inputs is already standard (μ = 0, σ = 1, the defaults here too),
  which fedsim's datasets are not: digits are in [0, 1], their mean brightness is 0.3052 ± 0.0332
  on the training set. `measurement_stats` computes μ and σ on a sample, as the server would on
  public data. With the wrong μ, σ most inputs share a few bins and come back as mixtures.
- `connection: addition` (the default here) is the official `forward`'s last branch: the block's
  output is the input plus s times the rows' mean on every coordinate, so the body sees the input
  (shifted by s·γ·mean_i (z − c_i)⁺: at most 3·10⁻⁵ on digits at the defaults) and the federation
  learns its task as the plain body does. The official config's `linear` connection (a trainable
  k → input-size layer of weights 1/γ, bias −mean(c)) passes the body only a function of z; it is
  here for fidelity, not for runs whose accuracy matters.
- `scale` s is fedsim's (the official addition has s = 1): the rows' gradients grow with s, which is
  what survives secure aggregation's quantisation (SecAgg+ rounds each coordinate to 2c/Q ≈ 4·10⁻⁶
  at its defaults, larger than a digit's one-step imprint gradient at s = 1).
- `gain` γ: the official `ImprintBlock` default is 10⁻³ (the rtf config sets 1.0 with the linear
  connection, whose weights 1/γ undo it); fedsim's is 10⁻⁵. The rows' gradients do not depend on γ
  but their weights do, and the server reads local − global rounded in float32 to the size of the
  weights: on 3 clients × 8 digits, one step each, k = 256, 213 of 213 inputs alone in their bin
  came back to 10⁻⁴ with γ = 10⁻⁵, 178 of 213 with γ = 10⁻³ (10 draws). A small γ makes the rows
  move far in each step relative to their size: after several local steps (FedAvg) the bins blur
  whatever γ (40-58% of lone inputs exact at 2-4 steps of batch 4, for γ from 10⁻⁵ to 10⁻²).
- The DCT row is the orthonormal DCT-II basis vector of `mode` over the flattened input; the official
  scales it by an ad-hoc factor (`/ N * max(mode, 0.33) * 4`) that the standardisation makes moot.
- The random direction comes from its own generator (`seed`), not torch's global one, so its μ and
  σ can be computed before the scenario's model is built. The body is built first, so its initial
  weights are those of the plain body under the same seed.
- The block is planted once: fedsim's server applies each round's aggregate to it like any layer
  (the official one-shot attack resets the model each query). Training pushes its rows out of the
  data's range within a round or two (then the block passes the input exactly and leaks nothing):
  attack round 1.
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, BeforeValidator, Field, SerializeAsAny
from torch import nn

from fedsim.models import nets
from fedsim.registry import MODELS, Params, nested_mapping

LOWEST_EDGE = -10.0  # the official first bin edge: row 0 is active for every input (Φ(−10) ≈ 0)


def parse_body(value: Any) -> BaseModel:
    """The body model's spec, validated against the model registry: `name` plus that model's own
    fields. A bare name is shorthand for `{name: ...}`; a mapping without `name` means mlp."""
    value = nested_mapping(value, "body", "model", "mlp")
    name = value["name"]
    allowed = [n for n in MODELS.names() if n != "imprint"]
    if name not in allowed:
        why = "the imprint block wraps one ordinary model" if name == "imprint" else f"unknown model {name!r}"
        raise ValueError(f"body.name: {why}; allowed: {', '.join(allowed)}")
    return _spec_model(name).model_validate({**value, "name": name})


@functools.lru_cache(maxsize=None)
def _spec_model(name: str) -> type[BaseModel]:
    """The YAML model of one body, built once per name: specs of the same body compare equal, and
    pydantic model creation is slow."""
    return MODELS.get(name).spec_model()


BodySpec = Annotated[SerializeAsAny[BaseModel], BeforeValidator(parse_body)]


class ImprintParams(Params):
    body: BodySpec = Field(default_factory=lambda: parse_body("mlp"),
                           description="the ordinary network behind the block: {name: <model>, <its fields>}")
    bins: int = Field(64, ge=2, le=1 << 16, description="k, the imprint rows (bins); the official rtf config's 64")
    measurement: Literal["brightness", "random", "fourier"] = Field(
        "brightness", description="what every row measures: the mean of the input (official linfunc 'avg'), a "
        "fixed random projection ('randn') or one DCT-II coefficient ('fourier', the official config's)")
    mode: int = Field(32, ge=0, description="fourier: the DCT-II mode over the flattened input (official config: 32)")
    seed: int = Field(0, ge=0, description="random: the seed of the projection's own generator")
    mean: float = Field(0.0, description="μ, the measurement's mean on the data (official assumption: 0)")
    std: float = Field(1.0, gt=0, description="σ, the measurement's standard deviation on the data (official "
                       "assumption: 1); measurement_stats computes μ and σ on a sample")
    distribution: Literal["normal", "laplace"] | None = Field(
        None, description="whose quantiles the bin edges are: None = the official choice, laplace (variance 1) for "
        "fourier, normal otherwise")
    gain: float = Field(1e-5, gt=0, le=1e3, description="γ, the rows' scale: smaller reads one-step sums more "
                        "exactly in float32 (official ImprintBlock default 1e-3: see the module docstring)")
    scale: float = Field(1.0, gt=0, le=1e6, description="addition: s, the factor on the rows' mean added to the "
                         "input (official: 1); the rows' gradients grow with s, the shift the body sees with s·γ")
    connection: Literal["addition", "linear"] = Field(
        "addition", description="how the block's output returns to the input's shape: addition (input + the rows' "
        "mean: the body sees the input) or linear (the official config's k → input layer: the body sees only the measurement)")
    replant: bool = Field(False, description="the server writes the block back to its planted weights after every "
                          "server step, so each round's broadcast carries it (as a malicious server may); false: the "
                          "block trains with the model and blurs after a round or two")


def replanted(params: ImprintParams) -> tuple[str, ...]:
    """The parameters a re-planting server writes back before each broadcast: the block's."""
    if not params.replant:
        return ()
    return ("imprint.weight", "imprint.bias") + (("back.weight", "back.bias") if params.connection == "linear" else ())


def measurement_vector(kind: str, size: int, mode: int = 32, seed: int = 0) -> torch.Tensor:
    """a [size]: the direction every row measures, m(x) = a · x over the flattened input."""
    if kind == "brightness":
        return torch.full((size,), 1.0 / size)
    if kind == "random":
        a = torch.randn(size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        return ((a - a.mean()) / a.std() / math.sqrt(size)).float()  # the official normalisation
    if kind == "fourier":
        if not 0 <= mode < size:
            raise ValueError(f"mode={mode}: the fourier measurement's mode must be below the input size {size}")
        n = torch.arange(size, dtype=torch.float64)
        a = torch.cos(math.pi / size * (n + 0.5) * mode)
        return (a / a.norm()).float()  # orthonormal DCT-II basis vector
    raise ValueError(f"unknown measurement {kind!r}")


def bin_edges(bins: int, distribution: str) -> torch.Tensor:
    """[k] c_0 = −10, c_i = F⁻¹(i/k): the k bins hold equal mass of a standard (variance 1) law."""
    def quantile(p: float) -> float:
        if distribution == "normal":
            return NormalDist().inv_cdf(p)
        b = 1 / math.sqrt(2)  # Laplace(0, 1/√2) has variance 1
        return b * math.log(2 * p) if p < 0.5 else -b * math.log(2 - 2 * p)

    return torch.tensor([LOWEST_EDGE] + [quantile(i / bins) for i in range(1, bins)], dtype=torch.float32)


def measurement_stats(params: ImprintParams, x: torch.Tensor) -> tuple[float, float]:
    """(μ, σ) of the block's measurement on a sample `x` [n, *input_shape]: what the server
    estimates on public data to set `mean` and `std`."""
    flat = torch.as_tensor(x).flatten(1).double()
    m = flat @ measurement_vector(params.measurement, flat.shape[1], params.mode, params.seed).double()
    return float(m.mean()), float(m.std())


class ImprintModel(nn.Module):
    """The imprint block (`imprint`: k rows, and `back` for the linear connection) before `body`.

    `classifier` and `features` follow the registered nets' convention (fedsim/models/nets.py), so
    defenses that split a net at its head see the body's head and the embedding of the block's
    output."""

    def __init__(self, input_shape: tuple[int, ...], body: nn.Module, params: ImprintParams) -> None:
        super().__init__()
        self.input_shape = tuple(input_shape)
        size = math.prod(self.input_shape)
        k, gamma = params.bins, params.gain
        distribution = params.distribution or ("laplace" if params.measurement == "fourier" else "normal")
        a = measurement_vector(params.measurement, size, params.mode, params.seed)
        edges = bin_edges(k, distribution)
        self.imprint = nn.Linear(size, k)
        with torch.no_grad():
            self.imprint.weight.copy_((gamma * a / params.std).expand(k, size))
            self.imprint.bias.copy_(-gamma * (params.mean / params.std + edges))
        self.connection, self.scale = params.connection, params.scale
        if params.connection == "linear":  # the official: all-ones / γ, bias − mean of the edges
            self.back = nn.Linear(k, size)
            with torch.no_grad():
                self.back.weight.fill_(1.0 / gamma)
                self.back.bias.fill_(-float(edges.mean()))
        self.body = body

    def block(self, x: torch.Tensor) -> torch.Tensor:
        """What the body receives: the input plus the rows' mean (addition), or the rows mapped back."""
        h = torch.relu(self.imprint(x.flatten(1)))
        if self.connection == "linear":
            return self.back(h).view(x.shape)
        return x + self.scale * h.mean(dim=1).view(-1, *([1] * (x.dim() - 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.block(x))

    @property
    def classifier(self) -> nn.Module:
        return nets.head(self.body)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return nets.features(self.body, self.block(x))


@MODELS.register("imprint", ImprintParams, replanted=replanted)
def imprint(input_shape: tuple[int, ...], num_classes: int, params: ImprintParams) -> nn.Module:
    """Robbing the Fed's malicious imprint block before a body net (Fowl et al., ICLR 2022): inputs leak from sums."""
    entry = MODELS.get(params.body.name)
    body = entry.obj(tuple(input_shape), num_classes, params.body)  # first: the body's init is the plain net's
    return ImprintModel(input_shape, body, params)
