"""Turn one raw image or caption into a clean value, or into a short, stable reason for refusing it.

Contracts:

- ``decode_image(src)`` returns an RGB image (plus a note when its pixels had to be changed to get
  there) or raises :class:`BadImage`. It never returns a half-decoded image: the whole file is
  decoded before it returns, so truncation surfaces here and not later inside a transform.
- ``validate_caption(x)`` returns the stripped caption or raises :class:`BadCaption`.
- ``BadImage.reason`` / ``BadCaption.reason`` are stable category strings (safe to count and to
  compare in tests); ``detail`` carries the item-specific part (a size, a type, PIL's message).

Data sources (``extract.data.sources``) build on these two functions; nothing here knows about files of
captions, shards or datasets.
"""
from __future__ import annotations

import io
import unicodedata
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, UnidentifiedImageError

__all__ = [
    "BadCaption",
    "BadImage",
    "DecodedImage",
    "decode_image",
    "validate_caption",
]

Unusual = Literal["convert", "skip"]

_WHITE = (255, 255, 255, 255)
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
# Modes whose RGB conversion only replicates or drops channels: nothing to report.
_LOSSLESS_MODES = ("RGB", "L", "1", "RGBX")


class _Rejected(ValueError):
    """A raw item refused for a stable ``reason``; ``detail`` says what exactly was wrong."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class BadImage(_Rejected):
    """An image that cannot (or, by policy, may not) be decoded into RGB."""


class BadCaption(_Rejected):
    """A caption that is not usable text."""


@dataclass(frozen=True)
class DecodedImage:
    """A fully decoded RGB image; ``note`` says how its pixels were changed, None when they were not."""

    image: Image.Image
    note: str | None = None


def decode_image(
    src: str | Path | bytes,
    max_pixels: int | None = None,
    unusual: Unusual = "convert",
) -> DecodedImage:
    """Decode a path or encoded bytes into an RGB image, or raise :class:`BadImage`.

    ``max_pixels`` (default: PIL's ``Image.MAX_IMAGE_PIXELS`` at call time; None there means no
    limit) is checked against the header's width x height before any pixel is decoded. PIL itself
    still refuses images above twice its own limit, so a larger ``max_pixels`` also needs
    ``Image.MAX_IMAGE_PIXELS`` raised.

    ``unusual="convert"`` converts modes whose pixels must change to become RGB and says how in
    ``note``; ``unusual="skip"`` refuses those images instead. The conversions: CMYK via PIL;
    16-bit grayscale (and 32-bit ``I`` within 0..65535) divided by 257; other ``I`` and float
    images min-max scaled (float already in [0, 1]: times 255); used transparency (RGBA, LA, PA,
    palette with a transparent index) composited on white. Lossless conversions (L, 1, RGBX,
    palette without transparency, alpha that is fully opaque) are silent and never refused.
    Multi-frame files give their first frame; EXIF orientation is not applied (as in open_clip).
    Not thread-safe to call from several threads at once (``warnings.catch_warnings``); processes
    (DataLoader workers) are fine.
    """
    if unusual not in ("convert", "skip"):
        raise ValueError(f"unusual must be 'convert' or 'skip', not {unusual!r}")
    image = _open(_read_bytes(src))
    _check_size(image, Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels)
    _load_fully(image)
    return _to_rgb(image, unusual)


def validate_caption(x: object) -> str:
    """Return ``x`` stripped of surrounding whitespace, or raise :class:`BadCaption`.

    Refused: anything that is not a ``str`` (None, NaN, numbers, lists), empty or blank text, text
    with control characters other than whitespace or with undecodable bytes (binary data read as
    text), and text without a single letter (any script counts).
    """
    if not isinstance(x, str):
        raise BadCaption("caption is not text", type(x).__name__)
    text = x.strip()
    if not text:
        raise BadCaption("empty caption")
    bad = next((c for c in text if _is_binary(c)), None)
    if bad is not None:
        raise BadCaption("binary data in caption", f"character U+{ord(bad):04X}")
    if not any(c.isalpha() for c in text):
        raise BadCaption("caption has no letters", repr(text[:40]))
    return text


def _is_binary(c: str) -> bool:
    # Cc: control characters (NUL, ESC...); Cs: lone surrogates, which is how bytes that are not
    # UTF-8 arrive when text files are read with errors="surrogateescape".
    category = unicodedata.category(c)
    return category == "Cs" or (category == "Cc" and not c.isspace())


def _read_bytes(src: str | Path | bytes) -> bytes:
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
    else:
        try:
            data = Path(src).read_bytes()
        except FileNotFoundError:
            raise BadImage("file not found", str(src)) from None
        except OSError as e:  # a directory, no permission, an I/O error
            raise BadImage("unreadable file", f"{src}: {e.strerror or e}") from None
    if not data:
        raise BadImage("empty file")
    return data


def _open(data: bytes) -> Image.Image:
    """Parse the header only; PIL's pixel-count warning is left to :func:`_check_size`."""
    try:
        with warnings.catch_warnings():
            # Same threshold as our own check by default, which reports the size and refuses.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise BadImage("decompression bomb", str(e)) from None
    except Exception as e:  # PIL raises many types on hostile input; all mean the same here
        raise _classify(e) from None


def _check_size(image: Image.Image, max_pixels: int | None) -> None:
    width, height = image.size
    if width <= 0 or height <= 0:
        raise BadImage("zero-size image", f"{width}x{height} px")
    if max_pixels is not None and width * height > max_pixels:
        raise BadImage("decompression bomb", f"{width}x{height} px > limit {max_pixels}")


def _load_fully(image: Image.Image) -> None:
    # PIL decodes lazily; loading here, with ImageFile.LOAD_TRUNCATED_IMAGES left as it is
    # (False by default), makes a cut file fail now instead of yielding grey padding later.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise BadImage("decompression bomb", str(e)) from None
    except Exception as e:  # see _open
        raise _classify(e) from None


def _classify(error: Exception) -> BadImage:
    if isinstance(error, UnidentifiedImageError):  # its message names a memory address
        return BadImage("corrupt or unrecognised image data", "no image format recognises it")
    detail = f"{type(error).__name__}: {error}"
    if "truncat" in str(error).lower():
        return BadImage("truncated image data", detail)
    return BadImage("corrupt or unrecognised image data", detail)


def _to_rgb(image: Image.Image, unusual: Unusual) -> DecodedImage:
    if image.mode in _LOSSLESS_MODES:
        return DecodedImage(image.convert("RGB"))
    rgb, note = _convert_unusual(image)
    if note is None:
        return DecodedImage(rgb)
    if unusual == "skip":
        raise BadImage("unusual image mode", f"{image.mode} ({note}); pass unusual='convert' to keep it")
    return DecodedImage(rgb, note)


def _convert_unusual(image: Image.Image) -> tuple[Image.Image, str | None]:
    mode = image.mode
    if mode == "CMYK":
        return image.convert("RGB"), "CMYK converted to RGB"
    if mode in _SIXTEEN_BIT_MODES or mode == "I":
        return _integer_gray_to_rgb(np.asarray(image))
    if mode == "F":
        return _float_gray_to_rgb(np.asarray(image))
    if mode == "P" and "transparency" not in image.info:
        return image.convert("RGB"), None  # a palette lookup: every pixel keeps its colour
    if mode in ("P", "PA", "RGBA", "LA", "RGBa"):
        return _composite_on_white(image)
    try:
        return image.convert("RGB"), f"{mode} converted to RGB"
    except ValueError:
        raise BadImage("unsupported image mode", mode) from None


def _composite_on_white(image: Image.Image) -> tuple[Image.Image, str | None]:
    rgba = image.convert("RGBA")
    if rgba.getchannel("A").getextrema() == (255, 255):
        return rgba.convert("RGB"), None  # alpha declared but unused: nothing is lost
    white = Image.new("RGBA", rgba.size, _WHITE)
    note = "palette transparency composited on white" if image.mode in ("P", "PA") else (
        "transparency composited on white"
    )
    return Image.alpha_composite(white, rgba).convert("RGB"), note


def _integer_gray_to_rgb(values: np.ndarray) -> tuple[Image.Image, str]:
    # PIL's own convert("RGB") clips 16-bit values to 255, turning most of the image white.
    values = values.astype(np.int64)
    if values.min() >= 0 and values.max() <= 65535:
        return _gray(np.rint(values / 257.0)), "16-bit grayscale scaled to 8-bit"
    return _gray(_min_max(values)), "32-bit grayscale min-max scaled to 8-bit"


def _float_gray_to_rgb(values: np.ndarray) -> tuple[Image.Image, str]:
    values = np.nan_to_num(values.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    in_unit_range = values.min() >= 0.0 and values.max() <= 1.0
    scaled = np.rint(values * 255.0) if in_unit_range else _min_max(values)
    return _gray(scaled), "float grayscale scaled to 8-bit"


def _min_max(values: np.ndarray) -> np.ndarray:
    low, high = float(values.min()), float(values.max())
    if high == low:
        return np.zeros(values.shape)
    return np.rint((values - low) * (255.0 / (high - low)))


def _gray(values: np.ndarray) -> Image.Image:
    return Image.fromarray(np.clip(values, 0, 255).astype(np.uint8)).convert("RGB")
