"""The upload codec interface.

A codec turns a client's flat update into the arrays that cross the wire and back:
`encode(delta, layout, state) -> (payload, state)` on the client and `decode(payload, layout) ->
delta` on the server. `state` is the client's memory between rounds (error-feedback residuals),
a dict of numpy arrays kept in Flower's `Context.state`. The server treats every payload as
untrusted: `decode` checks names, dtypes and shapes and raises `PayloadError` with the reason.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from fedsim.models.layout import ModelLayout


class PayloadError(ValueError):
    """A client upload that cannot be decoded (wrong arrays, dtype or shape)."""


def excerpt(value, limit: int = 80) -> str:
    """A bounded rendering of an untrusted value (a key, a number, a list of names) for a rejection
    reason: whatever a client sends, the reason written to rounds.jsonl stays short."""
    return clip(repr(value), limit)


def clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def expect_array(payload: dict[str, np.ndarray], key: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Fetch `payload[key]`, insisting on its dtype and shape before anything else touches it."""
    if key not in payload:
        raise PayloadError(f"payload lacks array {key!r} (has {excerpt(sorted(payload))})")
    arr = payload[key]
    if arr.dtype != dtype:
        raise PayloadError(f"payload array {key!r} has dtype {arr.dtype}, expected {np.dtype(dtype)}")
    if arr.shape != shape:
        raise PayloadError(f"payload array {key!r} has shape {arr.shape}, expected {shape}")
    return arr


class Codec(ABC):
    def __init__(self, params) -> None:
        self.params = params

    @abstractmethod
    def encode(
        self, delta: torch.Tensor, layout: ModelLayout, state: dict[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The arrays to upload for `delta`, and the client's new codec state."""

    @abstractmethod
    def decode(self, payload: dict[str, np.ndarray], layout: ModelLayout) -> torch.Tensor:
        """The flat float32 update `[layout.dim]` the payload stands for."""
