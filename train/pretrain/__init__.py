"""Pre-training from scratch (``python -m train.pretrain``): the engine (engine), its data (data), checkpoints (checkpoint),
the methods side by side (compare)."""
from train.pretrain.engine import PretrainOptions, build_parser, main, pretrain

__all__ = ["PretrainOptions", "build_parser", "main", "pretrain"]
