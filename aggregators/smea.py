"""SMEA, smallest maximum eigenvalue averaging (Allouah, Guerraoui, Gupta, Pinot, Stephan, "On the
Privacy-Robustness-Utility Trilemma in Distributed Learning", ICML 2023).

Among all subsets S of n - f updates, take the one whose empirical covariance has the smallest
largest eigenvalue and average it:

    mu_S = (1 / |S|) sum_{i in S} x_i,      Sigma_S = (1 / |S|) sum_{i in S} (x_i - mu_S)(x_i - mu_S)^T,
    S* = argmin_{|S| = n - f} lambda_max(Sigma_S),      SMEA(x) = mu_{S*}

It needs n > 2f. With f = 0 it is the plain mean. lambda_max(Sigma_S) is computed exactly: the
non-zero eigenvalues of Sigma_S = Y^T Y / |S| (Y the centred rows of S) are those of the
[|S|, |S|] matrix Y Y^T / |S| = H G_S H / |S|, with G_S the subset's block of one float64 Gram
matrix and H the centring matrix, so each chunk of subsets is one batched `eigvalsh` on small
matrices: O(n^2 d + C(n, f) (n - f)^3), never a d x d matrix. A round with more than
`max_subsets` subsets is refused (100,000 by default: n = 20, f = 5 is 15,504; n = 25, f = 6
is 177,100).

Where ByzFL (0.0.11, `byzfl.SMEA`) differs: it estimates lambda_max with one step of the power
method from a random start vector (`torch.randn`/`np.random.randn`, unseeded), i.e. it scores a
subset by ||Sigma_S v|| for a random unit v. That is lambda_max only when d = 1; in higher
dimension it is a random fraction of it, different for every subset and call, so ByzFL's choice
is random unless the outliers are far enough that every estimate sees them. This module follows
the paper (the exact maximum eigenvalue); tests/test_aggregators_byzfl.py checks equal outputs
where ByzFL's choice does not depend on its random vector (d = 1, and far outliers; the golden
generator runs ByzFL under several seeds to tell), and elsewhere that fedsim's subset has an
eigenvalue no larger than any subset ByzFL chose.

Ties go to the lexicographically first subset (ByzFL: the same scan order with a strict `<`).
Unweighted, as in the paper. A subset holding a row with NaN or inf scores +inf.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsim.aggregators.base import check_inputs
from fedsim.aggregators.subsets import best_subset, check_majority, check_subset_count, gram64, subset_problem
from fedsim.registry import AGGREGATORS, Params

DEFAULT_MAX_SUBSETS = 100_000


def centred_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """H B H for a batch of [k, k] Gram blocks B (H = I - 11^T / k): the centred rows' Gram."""
    return (blocks - blocks.mean(dim=1, keepdim=True) - blocks.mean(dim=2, keepdim=True)
            + blocks.mean(dim=(1, 2), keepdim=True))


def subset_max_eigenvalues(gram: torch.Tensor, finite: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """[c] lambda_max of each subset's empirical covariance; +inf for a subset with a non-finite row."""
    k = chunk.shape[1]
    blocks = centred_blocks(gram[chunk[:, :, None], chunk[:, None, :]]) / k
    blocks = 0.5 * (blocks + blocks.transpose(1, 2))
    lam = torch.linalg.eigvalsh(blocks)[:, -1]
    return torch.where(finite[chunk].all(dim=1), lam, torch.inf)


def smea_select(updates: torch.Tensor, num_malicious: int, max_subsets: int = DEFAULT_MAX_SUBSETS) -> torch.Tensor:
    """[n - f] rows of the subset of smallest covariance eigenvalue (increasing index)."""
    n = updates.shape[0]
    check_majority("smea", n, num_malicious)
    check_subset_count("smea", n, num_malicious, max_subsets)
    gram, finite = gram64(updates)
    return best_subset(n, n - num_malicious, lambda chunk: subset_max_eigenvalues(gram, finite, chunk))[0]


class SMEAParams(Params):
    num_malicious: int = Field(1, ge=0, description="f: averages the n - f updates of smallest covariance eigenvalue; needs n > 2f")
    max_subsets: int = Field(DEFAULT_MAX_SUBSETS, ge=1, description="refuse a round with more than C(n, f) subsets to score")

    def round_problem(self, n: int):
        return subset_problem("smea", n, self.num_malicious, self.max_subsets)


def smea_with_info(updates: torch.Tensor, weights: torch.Tensor, num_malicious: int = 1,
                   max_subsets: int = DEFAULT_MAX_SUBSETS) -> tuple[torch.Tensor, dict]:
    """SMEA's output and the rows it averaged (for the round log)."""
    check_inputs(updates, weights)
    chosen = smea_select(updates, num_malicious, max_subsets)
    return updates[chosen].mean(dim=0), {"selected": chosen.tolist()}


@AGGREGATORS.register("smea", SMEAParams, with_info=smea_with_info)
def smea(updates: torch.Tensor, weights: torch.Tensor, num_malicious: int = 1,
         max_subsets: int = DEFAULT_MAX_SUBSETS) -> torch.Tensor:
    """Smallest maximum eigenvalue averaging: the mean of the n - f updates of least spread (Allouah et al. 2023)."""
    return smea_with_info(updates, weights, num_malicious, max_subsets)[0]
