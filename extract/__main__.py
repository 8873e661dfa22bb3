"""``python -m extract``: see :mod:`extract.pipeline`."""


def main() -> int:
    """Parse first (no torch: --help and argument errors answer at once), then import the pipeline and run."""
    import sys

    from extract.options import parse_args

    opts = parse_args(sys.argv[1:])
    from extract.common.cli import run_job
    from extract.pipeline import run

    return run_job(run, opts)


if __name__ == "__main__":
    raise SystemExit(main())
