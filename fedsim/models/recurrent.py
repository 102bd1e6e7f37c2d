"""Recurrent text models on int64 token ids, registered by YAML name.

- `lstm`: the Sentiment140 classifier of Attack of the Tails (`language-tasks-fl`): embedding →
  LSTM → linear head on the last real token's hidden state. Sizes are fedsim's choice where the
  reference notes give none: embedding 200, hidden 200, 2 layers. Inputs are `[N, L]` ids from
  fedsim/data/text.py, 0 = padding, so the vocabulary is `vocab_size` (default 10,000 words + the
  2 reserved ids PAD and UNKNOWN).
- `char_lstm`: LEAF's Shakespeare model (models/shakespeare/stacked_lstm.py): embedding 8 → 2-layer
  LSTM 256 → dense over the 80 characters, read from the last position. Inputs are `[N, 80]` ids
  from fedsim/data/leaf.py; the vocabulary is the 80 characters (= num_classes unless set).

The builders get `input_shape` = (L,) and the number of classes; the vocabulary cannot be inferred
from them, hence the `vocab_size` parameter.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn

from fedsim.registry import MODELS, Params

PAD = 0  # fedsim/data/text.py's padding id


class LstmClassifier(nn.Module):
    """Embedding → LSTM → `classifier`. With `skip_padding`, each sequence is read at its last
    non-padding token (trailing PAD ids, as text.py writes them, are ignored); otherwise at the last
    position. `features(x)` is the classifier's input."""

    def __init__(self, vocab_size: int, embed_dim: int, hidden: int, layers: int, num_classes: int,
                 dropout: float, skip_padding: bool) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.skip_padding = skip_padding
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=PAD if skip_padding else None)
        self.lstm = nn.LSTM(embed_dim, hidden, layers, batch_first=True, dropout=dropout if layers > 1 else 0.0)
        self.classifier = nn.Linear(hidden, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.int64, torch.int32) or x.dim() != 2:
            raise ValueError(f"expected int64 token ids [N, L], got {x.dtype} {tuple(x.shape)}")
        if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}); got [{int(x.min())}, {int(x.max())}]"
                             " (set the model's vocab_size)")
        out, _ = self.lstm(self.embedding(x))  # [N, L, hidden]
        if self.skip_padding:
            last = ((x != PAD).sum(dim=1) - 1).clamp(min=0)  # an all-padding row reads position 0
        else:
            last = torch.full((x.shape[0],), x.shape[1] - 1, dtype=torch.long, device=x.device)
        return out[torch.arange(x.shape[0], device=x.device), last]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _sequence_length(name: str, input_shape: tuple[int, ...]) -> int:
    if len(input_shape) != 1:
        raise ValueError(f"{name} needs token-id inputs of shape (L,), got {input_shape}")
    return int(input_shape[0])


class LstmParams(Params):
    vocab_size: int = Field(10_002, ge=2, description="embedding rows: text.py's vocab_size words + PAD and UNKNOWN")
    embed_dim: int = Field(200, ge=1, description="embedding width")
    hidden: int = Field(200, ge=1, description="LSTM hidden size")
    layers: int = Field(2, ge=1, description="stacked LSTM layers")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout between LSTM layers")


@MODELS.register("lstm", LstmParams)
def lstm(input_shape: tuple[int, ...], num_classes: int, params: LstmParams) -> nn.Module:
    """Sentiment140 LSTM classifier (Attack of the Tails): embedding 200 → 2-layer LSTM 200 → linear."""
    _sequence_length("lstm", input_shape)
    return LstmClassifier(params.vocab_size, params.embed_dim, params.hidden, params.layers, num_classes,
                          params.dropout, skip_padding=True)


class CharLstmParams(Params):
    vocab_size: int | None = Field(None, ge=2, description="input characters (default: num_classes, LEAF's 80)")
    embed_dim: int = Field(8, ge=1, description="embedding width (LEAF: 8)")
    hidden: int = Field(256, ge=1, description="LSTM hidden size (LEAF: 256)")
    layers: int = Field(2, ge=1, description="stacked LSTM layers (LEAF: 2)")


@MODELS.register("char_lstm", CharLstmParams)
def char_lstm(input_shape: tuple[int, ...], num_classes: int, params: CharLstmParams) -> nn.Module:
    """LEAF's Shakespeare next-character LSTM: embedding 8 → 2-layer LSTM 256 → dense over 80 characters."""
    _sequence_length("char_lstm", input_shape)
    return LstmClassifier(params.vocab_size or num_classes, params.embed_dim, params.hidden, params.layers,
                          num_classes, 0.0, skip_padding=False)
