"""``python -m extract``: see :mod:`extract.pipeline`."""
import os

# MKL (torch's CPU BLAS) may round differently when buffers are aligned differently, so a resumed or
# multi-process CPU run could differ from an uninterrupted one in the last bit. Its alignment-independent
# mode must be chosen before torch loads MKL, hence here, before the imports below.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from extract.pipeline import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
