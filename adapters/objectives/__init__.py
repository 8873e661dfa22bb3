"""Pre-training objectives, one file each; every module here registers itself in ``adapters.registry.PRETRAIN``. base:
the contract every objective fulfils; towers: forward passes beyond encode_image / encode_text; hard_negatives:
NegCLIP's extra texts for any objective."""
