"""``--config file.yaml`` for every entry point: the file sets defaults, the command line overrides them,
and the resolved configuration is written next to the outputs so a run can be repeated exactly."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

import yaml


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; values in the YAML file named by ``--config`` become defaults (keys may use - or _).

    An unknown key in the file is an error that lists the accepted keys (a typo must not be ignored).
    """
    if not any(a.dest == "config" for a in parser._actions):
        parser.add_argument("--config", default=None, help="YAML file whose keys set defaults for these options")
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        path = Path(pre.config)
        if not path.is_file():
            parser.error(f"--config {path}: no such file")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            parser.error(f"--config {path}: expected a mapping of option: value, got {type(values).__name__}")
        known = {a.dest for a in parser._actions if a.dest not in ("help", "config")}
        values = {str(k).replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(values) - known)
        if unknown:
            parser.error(f"--config {path}: unknown key(s) {', '.join(unknown)}; accepted: {', '.join(sorted(known))}")
        parser.set_defaults(**values)
    return parser.parse_args(argv)


def save_config(args: argparse.Namespace | dict, path: str | Path) -> Path:
    """Write the resolved configuration as JSON (paths and tuples made plain); returns the path."""
    data = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    return path
