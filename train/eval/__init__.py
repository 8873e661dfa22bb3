"""Evaluation jobs (``python -m train.eval``): the evaluation itself (evaluate), zero-shot (zeroshot), the linear probe
(linear_probe), compositional benchmark readers (datasets), CLIP_benchmark interop (clip_benchmark), the NLA accuracy
report (nla_report), shape and position probes (shape_probe), heatmap accuracy (heatmaps)."""
