"""Plumbing every job uses: options dataclasses and their parsers (cli), ``--config`` YAML (config), the data-source
flags (source_args), run folders (run_dir), safetensors files with digests (tensorfile)."""
