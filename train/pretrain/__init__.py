"""Pre-training from scratch (``python -m train.pretrain``): the engine (engine), its data (data), checkpoints (checkpoint),
the methods side by side (compare)."""

__all__ = ["PretrainOptions", "build_parser", "main", "pretrain"]


def __getattr__(name: str):
    """The engine's public names, imported on first use (PEP 562): a module of this package that needs only its
    data or checkpoints does not load the engine."""
    if name in __all__:
        from train.pretrain import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
