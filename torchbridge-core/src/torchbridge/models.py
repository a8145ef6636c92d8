"""Reference models used by the benchmark and the tests: one of each kind users bring."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


class ConvNet(nn.Module):
    """A small ResNet-style conv net with BatchNorm."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()

        def block(cin: int, cout: int, stride: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU())

        self.features = nn.Sequential(block(3, width, 1), block(width, width, 1),
                                      block(width, 2 * width, 2), block(2 * width, 2 * width, 1),
                                      block(2 * width, 4 * width, 2))
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.features(x).mean(dim=(2, 3)))
        return logits


class TinyDecoderLM(nn.Module):
    """A decoder-only language model: embeddings, causal pre-norm blocks, tied LM head."""

    def __init__(self, vocab: int = 1024, dim: int = 256, heads: int = 4, layers: int = 2,
                 max_len: int = 256) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq = ids.shape[1]
        h = self.tok(ids) + self.pos(torch.arange(seq, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=ids.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        logits: torch.Tensor = self.norm(h) @ self.tok.weight.T
        return logits


def mlp(dim: int = 1024, hidden: int = 4096) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden),
                         nn.GELU(), nn.Linear(hidden, dim))


def encoder(dim: int = 256, heads: int = 4, layers: int = 2) -> nn.Module:
    layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


@dataclass(frozen=True)
class ReferenceModel:
    name: str
    build: Callable[[], nn.Module]
    make_input: Callable[[int], torch.Tensor]  # batch size -> input


def reference_models(scale: float = 1.0) -> list[ReferenceModel]:
    """scale < 1 shrinks every model (tests use 0.125); 1.0 is the benchmark's size."""
    def s(n: int) -> int:
        return max(8, int(n * scale))

    return [
        ReferenceModel("mlp", lambda: mlp(s(1024), s(4096)),
                       lambda b: torch.randn(b, s(1024))),
        ReferenceModel("convnet", lambda: ConvNet(s(32)),
                       lambda b: torch.randn(b, 3, s(64), s(64))),
        ReferenceModel("encoder", lambda: encoder(s(256), 4, 2),
                       lambda b: torch.randn(b, s(128), s(256))),
        # Positions up to the input's length: scale > 2 makes inputs longer than 256.
        ReferenceModel("decoder_lm", lambda: TinyDecoderLM(s(1024), s(256), 4, 2,
                                                           max_len=max(256, s(128))),
                       lambda b: torch.randint(0, s(1024), (b, s(128)))),
    ]
