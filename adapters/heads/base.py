"""The contract every adapter head fulfils (ComAlign, SmartCLIP, PowerCLIP NLA, and any new method).

A head is a small ``nn.Module`` trained on features of a frozen backbone. It never sees pixels or strings:
its inputs are the arrays ``python -m extract`` caches (see ``extract/cache.py`` / the README's table), as
torch tensors with a leading batch dimension:

- per image (``image_keys``): e.g. ``image_embed [B, D]``, ``patch_tokens [B, N, D]``,
  ``ventity_embed [B, E, D]`` + ``ventity_valid [B, E]``, ``region_masks [B, M, rows, cols]`` ...
- per caption (``text_keys``): e.g. ``text_embed [B, D]``, ``token_embed [B, L, D]`` + ``token_mask``,
  ``entity_embed [B, E, D]`` + ``entity_valid``, ``leaf_tokens [B, P, L]``, ``node_leaves [B, K, P]`` ...

The same arrays come from the cache during training and from the live backbone + extractors at evaluation
and serving time, so a head scores exactly the same way in both. The training loop (``train.adapter``)
knows nothing about a method beyond this class: it reads ``components`` / ``extract_options`` to build the
cache, feeds ``image_keys`` / ``text_keys`` batches to ``encode_image`` / ``encode_text``, calls ``loss``, and
saves ``config`` + ``state_dict`` in the checkpoint. Every ``Config`` field also becomes a command-line flag of
``python -m train.adapter`` (``--layers``, ``--train`` ...; the field's ``metadata["help"]`` is its help text).

Optional hooks with defaults: ``score_directed`` (+ ``directional``) for heads whose text->image and
image->text scores differ, ``fit_inference`` for inference-only parameters fitted on the validation split,
``param_groups`` for the optimizer. Required for serving: ``first_stage_image`` / ``first_stage_text``, one
vector per item for the inner-product first stage that ``score`` then re-ranks.

Representations (``Reps``) are dicts of tensors whose first dimension indexes items, as in
:mod:`adapters.scoring`, so evaluation can chunk and concatenate them without knowing what is inside.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

Reps = dict[str, Tensor]


class AdapterHead(nn.Module):
    """Base class of registered adapter heads (``@ADAPTERS.register(name)`` on the subclass).

    Subclasses set the class attributes and implement ``encode_image``, ``encode_text``, ``score`` and
    ``loss``. ``Config`` is a dataclass whose defaults are the paper's settings; the head is rebuilt from
    ``Config(**checkpoint_json["config"])`` and ``embed_dim`` alone.
    """

    name: ClassVar[str] = "base"
    Config: ClassVar[type] = type(None)
    #: extraction components the cache must hold (subset of extract.options.COMPONENTS)
    components: ClassVar[tuple[str, ...]] = ()
    #: extraction options this method needs beyond the defaults, e.g. {"regions": "random"}
    extract_options: ClassVar[dict[str, Any]] = {}
    #: cache arrays read per image / per caption
    image_keys: ClassVar[tuple[str, ...]] = ("image_embed",)
    text_keys: ClassVar[tuple[str, ...]] = ("text_embed",)
    #: True when ``score_directed`` differs between "t2i" and "i2t" (evaluation then ranks each direction with
    #: its own matrix); False: one matrix serves both
    directional: ClassVar[bool] = False
    #: True when the head can also train with the backbone unfrozen (``train.adapter --unfreeze``): its inputs
    #: must all be arrays a backbone forward produces (see ``train/adapter/live.py``)
    supports_unfreeze: ClassVar[bool] = False
    #: True when every text array the head reads is made from the caption's tokens after truncation alone (no
    #: spaCy parse of the whole caption): two captions with the same tokens are then the same input to it
    text_from_tokens: ClassVar[bool] = False
    #: ``train.adapter --hard-negatives`` when the run does not say: "none", "all" or a comma list of types
    hard_negatives: ClassVar[str] = "none"

    def __init__(self, config: Any, embed_dim: int):
        super().__init__()
        self.config = config
        self.embed_dim = embed_dim

    # -- the method ------------------------------------------------------------------------------------
    def encode_image(self, batch: dict[str, Tensor]) -> Reps:
        """image_keys arrays [B, ...] -> representation with first dim B."""
        raise NotImplementedError

    def encode_text(self, batch: dict[str, Tensor]) -> Reps:
        """text_keys arrays [B, ...] -> representation with first dim B."""
        raise NotImplementedError

    def score(self, image_reps: Reps, text_reps: Reps) -> Tensor:
        """[I, T] scores, higher = better match (what evaluation ranks by)."""
        raise NotImplementedError

    def score_directed(self, image_reps: Reps, text_reps: Reps, direction: str) -> Tensor:
        """[I, T] scores for one retrieval direction: ``"t2i"`` (each text ranks the images, i.e. a column is
        compared) or ``"i2t"`` (each image ranks the texts, a row is compared). Only heads whose directions
        differ (``directional = True``, e.g. ComAlign eq. 10-11) override it; by default both are ``score``."""
        return self.score(image_reps, text_reps)

    def logits(self, image_reps: Reps, text_reps: Reps) -> Tensor:
        """[I, T] image->text logits for a softmax over texts: :meth:`score` times the inverse temperature the
        head's own loss uses (hard negatives' extra columns, ``train.adapter.negatives``). Default: CLIP's initial
        1/0.07; heads with a learnt or configured scale override it."""
        return self.score(image_reps, text_reps) / 0.07

    # -- serving: the first stage ------------------------------------------------------------------------
    # A served collection is searched in two stages (``serve``): an inner-product index (FAISS) over one vector
    # per item finds K candidates, then ``score`` / ``score_directed`` re-ranks them exactly. These two methods
    # give those vectors: ``<first_stage_image(i, d), first_stage_text(t, d)>`` must rank the candidates of
    # direction ``d`` ("t2i": a text's images, "i2t": an image's texts) as closely to the head's score as one
    # vector per item can. The default is the base backbone's global cosine (``image_embed`` / ``text_embed``
    # are cached for every head); a head overrides them with what its own score is made of.
    def first_stage_image(self, image_reps: Reps, direction: str = "t2i") -> Tensor:
        """[I, F] vectors of images for the inner-product first stage of ``direction``."""
        raise NotImplementedError(f"{self.name}: no first-stage vectors (first_stage_image / first_stage_text)")

    def first_stage_text(self, text_reps: Reps, direction: str = "t2i") -> Tensor:
        """[T, F] vectors of texts for the inner-product first stage of ``direction``."""
        raise NotImplementedError(f"{self.name}: no first-stage vectors (first_stage_image / first_stage_text)")

    def loss(self, image_reps: Reps, text_reps: Reps, *, rank: int = 0, world_size: int = 1) -> dict[str, Tensor]:
        """Training objective on a batch of B matching pairs (pair b = image b, caption b); on many ranks the
        global batch is the rank-ordered concatenation. Returns ``{"loss": scalar, <part>: detached scalar}``."""
        raise NotImplementedError

    def fit_inference(self, image_reps: Reps, text_reps: Reps, caption_image: Tensor) -> dict[str, float]:
        """Optional: fit inference-only parameters (e.g. ComAlign's fusion weights, eq. 10-11) on a held-out
        split after training; stored in the state dict. Returns what was fitted, for the log."""
        return {}

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW parameter groups (the loop adds the learning rate). Default, as open_clip: weight decay on
        matrices only; biases, norm gains and scalars (a logit scale) get none. Override for per-part learning
        rates (a group may carry its own ``lr``)."""
        decay, no_decay = [], []
        for _, p in self.named_parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        return [g for g in ({"params": decay, "weight_decay": weight_decay},
                            {"params": no_decay, "weight_decay": 0.0}) if g["params"]]

    # -- description -----------------------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.config) if dataclasses.is_dataclass(self.config) else dict(self.config)

    @classmethod
    def from_config(cls, config: dict[str, Any] | None, embed_dim: int) -> "AdapterHead":
        """Rebuild from a checkpoint's JSON (unknown keys are an error: they mean another version)."""
        fields = {f.name for f in dataclasses.fields(cls.Config)}
        unknown = set(config or {}) - fields
        if unknown:
            raise ValueError(f"{cls.name}: unknown config key(s) {sorted(unknown)}; known: {sorted(fields)}")
        return cls(cls.Config(**(config or {})), embed_dim)


def to_tensors(batch: dict, device: torch.device | str, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """numpy / tensor arrays -> tensors on ``device``; floating arrays (fp16 in the cache) become ``dtype``."""
    out = {}
    for k, v in batch.items():
        t = torch.as_tensor(v)
        out[k] = t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
    return out
