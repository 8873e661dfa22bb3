"""Pre-training objectives, one file each; every module here registers itself in ``adapters.registry.PRETRAIN``."""
