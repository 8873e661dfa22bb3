"""The evaluation library: metrics over any scorer (``adapters.scoring``), below every job that reports them.

- ``retrieval``: image-text retrieval with several captions per image, strict and multi-positive, from a scorer's
  representations or a feature cache (what ``python -m train.eval`` reports and ``python -m serve.query
  --recall`` checks the served ranks against);
- ``multipositive``: any-true R@k and mAP where a caption can be true of several images (the toy world's truth);
- ``bootstrap``: per-query values, paired bootstrap intervals over test images, mean +/- sd over seeds;
- ``fit``: the held-out objective the heads' inference fits maximise (ComAlign's fusion weights, PowerCLIP's beta).

The job, its tasks and reports stay in ``train/eval/evaluate.py``.
"""
