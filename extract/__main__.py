"""``python -m extract``: see :mod:`extract.pipeline`."""
from extract.pipeline import main

if __name__ == "__main__":
    raise SystemExit(main())
