"""plugvlm training, pre-training and evaluation entry points (``python -m train.<module>``)."""
