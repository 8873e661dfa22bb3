"""What a head's inference fit maximises on the held-out split: the one objective ComAlign's fusion weights and
PowerCLIP's ``beta`` are both fitted by (``fit_inference``).

Text -> image: the mean of R@1/5/10. Image -> text: the mean of that and the mAP of each image's own captions.
Recall alone counts an image right when any one of its captions comes first, so a weight that lifts one caption
(the long one, naming every object) and pushes the others down scores best on it. Fitted on recall alone,
ComAlign cost I2T mAP 19 points on the toy world (76.4 -> 57.4, 3 seeds, train/README's binding table before this
objective), and PowerCLIP's ``beta`` weighed an untrained region score at 0.1 in 10 of 18 hard-world control runs
on held-out recall gains of 0.05-0.44 points, costing 6-8 points of I2T mAP and of add-obj (train/adapter/powerclip.md, "The
control's fitted beta"). ``both`` (one weight shared by the two directions, PowerCLIP's ``beta``) is the mean of the
two directions' objectives.
"""
from __future__ import annotations

import torch
from torch import Tensor

from adapters.eval.multipositive import ranked_truth
from adapters.eval.ranking import mean_recall

DIRECTIONS = ("t2i", "i2t", "both")


def own_caption_map(scores: Tensor, caption_image: Tensor) -> float:
    """Image -> text mAP (percent) of ``scores`` [I, T] where caption t belongs to image ``caption_image[t]``;
    images without a caption are left out."""
    own = caption_image.to(scores.device).long()[None, :] == torch.arange(len(scores), device=scores.device)[:, None]
    _, ap, n_true = ranked_truth(scores, own)
    return float(ap[n_true > 0].mean() * 100)


def fit_objective(scores: Tensor, caption_image: Tensor, direction: str) -> float:
    """The held-out figure an inference fit maximises for ``direction`` (percent; module docstring)."""
    if direction == "t2i":
        return mean_recall(scores, caption_image, "t2i")
    if direction == "i2t":
        return 0.5 * mean_recall(scores, caption_image, "i2t") + 0.5 * own_caption_map(scores, caption_image)
    if direction == "both":
        return 0.5 * (fit_objective(scores, caption_image, "t2i") + fit_objective(scores, caption_image, "i2t"))
    raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
