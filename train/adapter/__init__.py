"""Adapter training (``python -m train.adapter``): its options (options), the run in order (engine), one optimisation
step (step), the run's pieces (run), the training state and --resume (resume), the logs (logs), its data (data),
held-out evaluation in the loop (heldout), when to stop (stopping), training with the backbone (live), hard negatives
(negatives), every method side by side (compare)."""

__all__ = ["AdapterOptions", "build_parser", "main", "train"]


def __getattr__(name: str):
    """The options' and the engine's public names, imported on first use (PEP 562): a module of this package that
    needs only its data or checkpoints does not load the engine."""
    if name in ("AdapterOptions", "build_parser"):
        from train.adapter import options

        return getattr(options, name)
    if name in __all__:
        from train.adapter import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
