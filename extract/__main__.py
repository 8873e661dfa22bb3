"""``python -m extract``: see :mod:`extract.pipeline`."""
import os

# MKL (torch's CPU BLAS) may round differently when buffers are aligned differently, so a resumed or
# multi-process CPU run could differ from an uninterrupted one in the last bit. Its alignment-independent
# mode must be chosen before torch loads MKL, hence here, before the imports below.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")



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
