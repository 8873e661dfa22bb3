"""Adapter heads, one file each; every module here registers itself in ``adapters.registry.ADAPTERS``."""
