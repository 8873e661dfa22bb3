"""How plugvlm's jobs meet the command line: options as dataclasses, parsers derived from them, one-line errors,
``--quiet`` / ``--verbose``, and progress that reads well in a terminal and in a log file.

A job is a function of a dataclass of options (``evaluate(EvaluateOptions(model=["tiny"], data="toy"))``); its
command line only parses into that dataclass. Each field carries its flag's help, type, choices and group
(:func:`option`), :func:`build_parser` derives the parser from the fields, and :func:`check_options` puts a
dataclass built in Python through the very checks the flags get (types, choices, ranges), so a job called from
Python and one typed in a shell refuse the same bad values with the same messages.

Output. :func:`progress` is a tqdm bar on a terminal; when stderr is not a terminal (``> run.log 2>&1``, a
batch job) it prints one plain line every ``PLUGVLM_PROGRESS_SECONDS`` (30 s) instead of carriage-return frames
that pile up into one endless log line. ``--quiet`` keeps warnings, errors and results; ``--verbose`` adds
library logging. :func:`say` is the status line that ``--quiet`` silences.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from typing import Any, Iterable, Sequence

# --------------------------------------------------------------------------------------------- verbosity
QUIET, NORMAL, VERBOSE = 0, 1, 2
_verbosity = NORMAL


def set_verbosity(level: int) -> None:
    """QUIET: warnings, errors and results only; NORMAL; VERBOSE: also INFO logging of the libraries."""
    global _verbosity
    _verbosity = level
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(logging.INFO if level >= VERBOSE else logging.WARNING)


def verbosity() -> int:
    return _verbosity


_warned: set[str] = set()


def warn_once(line: str) -> bool:
    """Print a warning line the first time this process meets it (True), never again (False): a split too small
    for its metrics is evaluated every epoch and by every run of a comparison, and one line says it."""
    if line in _warned:
        return False
    _warned.add(line)
    print(line)
    return True


def forget_warnings() -> None:
    """Let every warning print again (for tests, and long-lived processes that start a new job)."""
    _warned.clear()


def clock(seconds: float) -> str:
    """A duration as people read it: "7 min 27 s" (59.6 s is "1 min 00 s", not "0 min 60 s")."""
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest:02d} s"


def say(*parts: Any, **kwargs) -> None:
    """A status line on stdout, silenced by ``--quiet`` (warnings and results use print)."""
    if _verbosity > QUIET:
        print(*parts, **kwargs)


# --------------------------------------------------------------------------------------------- parsers
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" only where the help does not already name the default, and not for switches or
    options without a default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        # identity, not equality: a default of 0 is worth showing, and 0 == False
        if ("default" in text.lower() or default is None or default is False or default is argparse.SUPPRESS
                or default == [] or default == "" or action.nargs == 0 or not action.option_strings):
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line with the fix (and where to see every option), not a usage
    dump; ``--quiet`` / ``--verbose`` on every command; and ``--help`` formatted by :class:`HelpFormatter`."""

    def __init__(self, *args, verbosity_flags: bool = True, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        if verbosity_flags:
            g = self.add_mutually_exclusive_group()
            g.add_argument("-q", "--quiet", action="store_true", help="print only warnings, errors and results")
            g.add_argument("-v", "--verbose", action="store_true", help="also print the libraries' log messages")

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n  (`{self.prog} --help` lists every option)\n")

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        # Only an explicit flag changes the verbosity: a job parsing another job's options (in-process) must not
        # switch the user's --quiet back off.
        if getattr(ns, "quiet", False) or getattr(ns, "verbose", False):
            set_verbosity(QUIET if ns.quiet else VERBOSE)
        return ns


def help_description(doc: str | None) -> str:
    """The first paragraph of a module docstring, for ``--help``, without its leading ``python -m x``: label."""
    first = (doc or "").strip().split("\n\n")[0].strip()
    if first.startswith("``") and "``:" in first:
        first = first.split("``:", 1)[1].strip()
    return first[:1].upper() + first[1:]


# --------------------------------------------------------------------------------------------- options as dataclasses
_ARG_KEYS = ("flags", "type", "choices", "action", "metavar", "group", "nargs", "positional")


def option(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING,
           flags: Sequence[str] | None = None, type: Any = None, choices: Sequence | None = None,
           action: str | type | None = None, metavar: str | None = None, group: str | None = None,
           nargs: Any = None, positional: bool = False) -> Any:
    """A dataclass field that is also a command-line option: ``--name-with-dashes`` unless ``flags`` say
    otherwise; ``type`` / ``choices`` / ``action`` / ``nargs`` / ``metavar`` as in argparse; ``group`` titles
    the --help section it appears in."""
    meta = {"help": help, "flags": tuple(flags) if flags else None, "type": type, "choices": choices,
            "action": action, "metavar": metavar, "group": group, "nargs": nargs, "positional": positional}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={"cli": meta})
    return dataclasses.field(default=default, metadata={"cli": meta})


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_options(parser: argparse.ArgumentParser, cls: type) -> argparse.ArgumentParser:
    """Add one argument per :func:`option` field of dataclass ``cls`` to ``parser``, in field order, grouped."""
    groups: dict[str | None, Any] = {None: parser}
    own = set(vars(cls).get("__annotations__", {}))
    # the class's own fields first, inherited ones (shared groups such as the data-source options) after them
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):
        meta = f.metadata.get("cli")
        if meta is None:
            continue
        target = groups.get(meta["group"])
        if target is None:
            target = groups[meta["group"]] = parser.add_argument_group(meta["group"])
        kwargs: dict[str, Any] = {"help": meta["help"], "default": _default(f)}
        for key in ("type", "choices", "action", "metavar", "nargs"):
            if meta[key] is not None:
                kwargs[key] = meta[key]
        if meta["positional"]:
            target.add_argument(f.name, **kwargs)
        else:
            target.add_argument(*(meta["flags"] or ("--" + f.name.replace("_", "-"),)), dest=f.name, **kwargs)
    return parser


def build_parser(cls: type, prog: str, doc: str | None = None) -> Parser:
    """The command line of a job whose options are dataclass ``cls``."""
    return add_options(Parser(prog=prog, description=help_description(doc)), cls)


def from_namespace(cls: type, ns: argparse.Namespace, **extra: Any):
    """An instance of ``cls`` from a parsed namespace (its option fields) plus ``extra`` fields."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(ns).items() if k in names}
    return cls(**{**values, **extra})


def parse_options(cls: type, parser: argparse.ArgumentParser, argv: Sequence[str] | None, check=None):
    """``argv`` (and its ``--config`` file) parsed into dataclass ``cls``. ``check(namespace)`` may raise
    ValueError for what the parser cannot say (an option required unless --config gives it); that, and a
    ValueError from ``cls`` itself, becomes the parser's one-line error."""
    from extract.common.config import parse_with_config

    ns = parse_with_config(parser, argv)
    try:
        if check is not None:
            check(ns)
        return from_namespace(cls, ns)
    except ValueError as e:
        parser.error(str(e))


def check_options(opts: Any, parser: argparse.ArgumentParser) -> None:
    """Raise ValueError ("epochs: expected an integer >= 1, got -1") for a field of dataclass ``opts`` that its
    flag would refuse: the same type, choice and range checks as the command line and ``--config``."""
    from extract.common.config import config_value

    actions = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(opts):
        action = actions.get(f.name)
        value = getattr(opts, f.name)
        if action is None or value is None or value == action.default:
            continue
        try:
            config_value(parser, action, _as_cli_value(value))
        except ValueError as e:
            raise ValueError(f"{f.name}: {e}") from None


def _as_cli_value(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


# --------------------------------------------------------------------------------------------- running a job
class JobFailed(RuntimeError):
    """A job that ran and could not finish (a diverged training run): ``exit_code`` is its status."""

    exit_code = 3


# 128 + SIGPIPE: the status a shell reports for a tool that SIGPIPE ended (``yes | head -1`` under pipefail).
# Python ignores SIGPIPE and raises BrokenPipeError instead; run_job ends such a job with the same status.
EXIT_BROKEN_PIPE = 141


def _stdout_gone() -> bool:
    """True when standard output is a pipe whose reader has closed it (``... | head -1`` after its line): poll
    reports POLLERR on such a pipe's write end. False where that cannot be asked (no file descriptor, no poll)."""
    try:
        import select

        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)  # POLLERR is reported whatever is asked for
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def _quiet_broken_pipe() -> int:
    """End a job whose standard output was closed by its reader, as the Python documentation recommends
    (library/signal.html, "Note on SIGPIPE"): point file descriptor 1 at /dev/null, so the output still buffered
    is dropped at exit instead of raising BrokenPipeError again ("Exception ignored ... BrokenPipeError");
    :data:`EXIT_BROKEN_PIPE`, no message."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


def run_job(job, opts, *, debug: bool = False) -> int:
    """Exit status of ``job(opts)`` for a command line: 0; 2 for what the user can fix (a missing or damaged file,
    absent weights, a bad setting, a missing extra: ``ValueError`` / ``OSError`` / ``ImportError`` and their
    kin); a :class:`JobFailed`'s own status (3: training diverged). Each failure is one ``error:`` line on
    stderr, no traceback (``PLUGVLM_DEBUG=1`` re-raises, for bug reports). A standard output its reader closed
    (``python -m serve.query IDX "..." --json | head -1``) is no failure of the job: it ends quietly with
    :data:`EXIT_BROKEN_PIPE` (141, as a tool that SIGPIPE ends), debug or not; stdout is flushed before the job
    counts as done, so that shows here rather than at interpreter exit."""
    debug = debug or os.environ.get("PLUGVLM_DEBUG", "") not in ("", "0")
    from extract.common.memory import keep_freed_memory

    keep_freed_memory()  # a job's steps reuse their freed tensors' pages (extract/common/memory.py)
    try:
        job(opts)
        if sys.stdout is not None:  # None under pythonw
            sys.stdout.flush()
    except JobFailed as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except (ValueError, OSError, ImportError, NotImplementedError) as e:
        if isinstance(e, BrokenPipeError) and _stdout_gone():  # another pipe (a worker's) is an error like any
            return _quiet_broken_pipe()
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


# --------------------------------------------------------------------------------------------- progress
def _log_interval() -> float:
    try:
        return max(1.0, float(os.environ.get("PLUGVLM_PROGRESS_SECONDS", "30")))
    except ValueError:
        return 30.0


class LogProgress:
    """tqdm's interface for logs: one plain line per interval (and one at the end if any was printed), never a
    carriage return. ``disable``: silent (other ranks, --quiet)."""

    def __init__(self, iterable: Iterable | None = None, total: int | None = None, desc: str = "", unit: str = "it",
                 disable: bool = False, initial: int = 0, interval: float | None = None, stream=None, **_ignored):
        self.iterable, self.desc, self.unit, self.disable = iterable, desc, unit, disable
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.n = self.start_n = initial
        self.postfix = ""
        self.interval = interval if interval is not None else _log_interval()
        self.stream = stream or sys.stderr
        self.started = self.last = time.monotonic()
        self.printed = False

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __len__(self):
        return self.total or 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if not self.disable and now - self.last >= self.interval:
            self.last = now
            self._line(now)

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k} {v}" for k, v in items.items())

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc

    def write(self, text: str) -> None:
        print(text, file=self.stream)

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        if not self.disable and self.printed:
            self._line(time.monotonic(), final=True)
        self.disable = True

    def _line(self, now: float, final: bool = False) -> None:
        elapsed = now - self.started
        rate = (self.n - self.start_n) / elapsed if elapsed > 0 else 0.0
        of = f"/{self.total}" if self.total else ""
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        eta = ""
        if self.total and rate > 0 and not final:
            eta = f", about {(self.total - self.n) / rate:.0f} s left"
        text = (f"{self.desc + ': ' if self.desc else ''}{self.n}{of} {self.unit}{pct} in {elapsed:.0f} s "
                f"({rate:.2f} {self.unit}/s{eta})" + (f"; {self.postfix}" if self.postfix else "")
                + (" done" if final else ""))
        print(text, file=self.stream, flush=True)
        self.printed = True


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
             disable: bool = False, leave: bool = False, initial: int = 0, **kwargs):
    """A progress bar: tqdm on a terminal, :class:`LogProgress` in a log, nothing with ``--quiet`` or
    ``disable``. Same interface either way (iterate it, or ``update`` / ``set_postfix`` / ``close``)."""
    disable = disable or _verbosity == QUIET
    if not disable and sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, initial=initial, dynamic_ncols=True,
                    **kwargs)
    return LogProgress(iterable, total=total, desc=desc, unit=unit, disable=disable, initial=initial)
