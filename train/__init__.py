"""plugvlm training, pre-training and evaluation entry points (``python -m train.<module>``)."""

import extract.numerics  # noqa: F401  MKL's reproducible mode before any matrix product
