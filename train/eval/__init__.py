"""Evaluation jobs (``python -m train.eval``): the evaluation itself (evaluate), zero-shot (zeroshot), the linear probe
(linear_probe), compositional benchmark readers (datasets; their items and field readers: bench_items; What'sUp:
whatsup), CLIP_benchmark interop (clip_benchmark), the NLA accuracy report (nla_report) and its batches
(nla_batches), shape and position probes (shape_probe), heatmap accuracy (heatmaps)."""
