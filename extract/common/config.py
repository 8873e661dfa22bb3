"""``--config file.yaml`` for every entry point: the file sets defaults, the command line overrides them,
and the resolved configuration is written next to the outputs so a run can be repeated exactly.

A value from the file passes the very checks its command-line flag does (the option's ``type``, its
``choices`` and the range checks of the types below), so ``lr: true`` or ``epochs: -3`` fail with the flag's
own message, naming the file and the key, instead of training with lr 1.0 or saving an untrained model.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

import yaml


# --------------------------------------------------------------------------------------------- range-checked types
def _number(kind: type, text: str, what: str):
    try:
        return kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (epochs, batch sizes, counts)."""
    v = _number(int, text, "an integer >= 1")
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0 (0 usually means "off"; the option's help says so)."""
    v = _number(int, text, "an integer >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _finite_float(text: str, what: str) -> float:
    v = _number(float, text, what)
    if v != v or v in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (learning rates, temperatures, time budgets)."""
    v = _finite_float(text, "a number > 0")
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {v:g}")
    return v


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (weight decay, clipping norms where 0 means off)."""
    v = _finite_float(text, "a number >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {v:g}")
    return v


def at_least_one(text: str) -> float:
    """argparse type: a finite number >= 1 (scale factors where 1 means unchanged)."""
    v = _finite_float(text, "a number >= 1")
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {v:g}")
    return v


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1) (held-out shares, drop ratios)."""
    v = _finite_float(text, "a number in [0, 1)")
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {v:g}")
    return v


# --------------------------------------------------------------------------------------------- --config
def _flag(action: argparse.Action) -> str:
    return action.option_strings[-1] if action.option_strings else action.dest


def _is_switch(action: argparse.Action) -> bool:
    """Options that take no value on the command line (store_true/false, --x/--no-x)."""
    return action.nargs == 0


def config_value(parser: argparse.ArgumentParser, action: argparse.Action, value: Any) -> Any:
    """A YAML value as the command line would have given it: converted and checked by the action's own
    ``type`` and ``choices``. Raises ValueError with the reason (the flag's own argparse message)."""
    if _is_switch(action):
        if not isinstance(value, bool):
            raise ValueError(f"{_flag(action)} is a switch: expected true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value
        return action.const if value else action.default
    if value is None:
        if action.default is None or action.default is argparse.SUPPRESS:
            return None
        raise ValueError(f"needs a value (the default is {action.default!r}); remove the key to keep the default")
    many = isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+") or isinstance(action.nargs, int)
    if not many and action.type is None and isinstance(value, list) and all(
            isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        value = ",".join(map(str, value))  # a YAML list for a comma-list option (--components, --holdout, ...)
    items = value if isinstance(value, list) else [value]
    if not many and isinstance(value, (list, dict)):
        raise ValueError(f"{_flag(action)} takes one value, got a {type(value).__name__}")
    converted = []
    for item in items:
        if isinstance(item, bool) or isinstance(item, (list, dict)):
            # YAML reads true/yes/on as booleans: the command line would have given a word, not a switch
            raise ValueError(f"{_flag(action)} expects a value as on the command line, got {item!r}")
        try:
            v = parser._get_value(action, str(item))
            parser._check_value(action, v)
        except argparse.ArgumentError as e:
            raise ValueError(str(e.message)) from None
        converted.append(v)
    return converted if many else converted[0]


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                      values: dict | None = None) -> argparse.Namespace:
    """Parse ``argv``; values in the YAML file named by ``--config`` become defaults (keys may use - or _).

    Every value is converted and checked as its flag is on the command line (module docstring). An unknown key
    in the file is an error that lists the accepted keys (a typo must not be ignored); so is a file that is not
    YAML or not a mapping. ``values``: the file's mapping when the caller has read it already (it needed a key
    before it could build ``parser``), so the file is read once.
    """
    if not any(a.dest == "config" for a in parser._actions):
        parser.add_argument("--config", default=None, help="YAML file whose keys set defaults for these options")
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        path = Path(pre.config)
        if values is None:
            values = config_file(path, parser.error)
        actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
        values = {str(k).replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(values) - set(actions))
        if unknown:
            parser.error(f"--config {path}: unknown key(s) {', '.join(unknown)}; accepted: {', '.join(sorted(actions))}")
        checked = {}
        for key, value in values.items():
            try:
                checked[key] = config_value(parser, actions[key], value)
            except ValueError as e:
                parser.error(f"--config {path}: key {key!r}: {e} (the check {_flag(actions[key])} gets on the "
                             "command line)")
        parser.set_defaults(**checked)
    return parser.parse_args(argv)


def config_file(path: Path, error) -> dict:
    """The mapping in ``--config``'s file; ``error`` for a file that does not exist or cannot be read."""
    if not Path(path).is_file():
        error(f"--config {path}: no such file")
    return read_config(path, error)


def read_config(path: Path, error) -> dict:
    """The mapping in a YAML config file; ``error(message)`` (e.g. ``parser.error``) for a file that cannot be
    read, is not YAML, or is not a mapping."""
    try:
        values = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        # PyYAML's message spans several lines with a snippet; one line: what it was parsing, where, and what it found
        parts = []
        for text, mark in ((getattr(e, "context", None), getattr(e, "context_mark", None)),
                           (getattr(e, "problem", None), getattr(e, "problem_mark", None))):
            if text:
                parts.append(text + (f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""))
        error(f"--config {path}: not valid YAML: {'; '.join(parts) or str(e).splitlines()[0]}")
    except (OSError, UnicodeDecodeError) as e:
        error(f"--config {path}: cannot be read ({type(e).__name__}: {e})")
    if values is None:
        return {}
    if not isinstance(values, dict):
        error(f"--config {path}: expected a mapping of option: value, got {type(values).__name__}")
    return values


def save_config(args: argparse.Namespace | dict, path: str | Path) -> Path:
    """Write the resolved configuration as JSON (paths and tuples made plain); returns the path."""
    data = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    return path
