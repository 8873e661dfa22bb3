"""Adapter training (``python -m train.adapter``): the engine (engine), its data (data), held-out evaluation in the loop
(heldout), training with the backbone (live), hard negatives (negatives), every method side by side (compare)."""
from train.adapter.engine import AdapterOptions, build_parser, main, train

__all__ = ["AdapterOptions", "build_parser", "main", "train"]
