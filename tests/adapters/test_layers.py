"""adapters/heads/layers.py: the heads' small building blocks."""
import torch

from adapters.heads.layers import ResidualLinear


def test_a_residual_linear_starts_as_the_identity_and_still_learns():
    layer = ResidualLinear(8)
    x = torch.randn(5, 8)
    assert torch.equal(layer(x), x)
    layer(x).sum().backward()
    assert layer.linear.weight.grad.abs().sum() > 0

