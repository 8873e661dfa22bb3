"""Small building blocks shared by adapter heads."""
from __future__ import annotations

from torch import Tensor, nn


class ResidualLinear(nn.Module):
    """x + W x + b with W = 0, b = 0 at init: the identity until training moves it, so a light projection
    starts from the base model's geometry (an untrained head scores exactly like its backbone) instead of a
    random one. The zero weights still receive gradients (d/dW = grad x^T)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.linear(x)
