"""Adapter heads, one file each; every module here registers itself in ``adapters.registry.ADAPTERS``. base: the contract
every head fulfils; layers: building blocks they share."""
