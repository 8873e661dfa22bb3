"""Speed runs, one per part: each a ``python -m train.bench.<part>`` script that prints figures and ratios measured in one
run (never a timed test): extract, adapter, pretrain, nla, retrieval, serve, serve_load (a running app under load)."""
