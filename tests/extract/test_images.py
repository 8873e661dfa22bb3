"""decode_image and validate_caption: every refusal has its stable reason, every conversion is right."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
from PIL import Image, ImageFile

from extract.data.images import BadCaption, BadImage, decode_image, validate_caption


def encode(image: Image.Image, fmt: str, **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def noise(size: int = 64) -> Image.Image:
    """Incompressible pixels, so cutting an encoded file lands inside the pixel data."""
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image).astype(int)


def reason_of(src, **kwargs) -> str:
    with pytest.raises(BadImage) as info:
        decode_image(src, **kwargs)
    return info.value.reason


# --------------------------------------------------------------------------- refusals


def test_good_rgb_image_has_no_note(tmp_path):
    path = tmp_path / "ok.png"
    Image.new("RGB", (5, 3), (10, 20, 30)).save(path)
    decoded = decode_image(path)
    assert decoded.note is None
    assert decoded.image.mode == "RGB" and decoded.image.size == (5, 3)
    assert decoded.image.getpixel((4, 2)) == (10, 20, 30)
    assert decode_image(path.read_bytes()).image.getpixel((0, 0)) == (10, 20, 30)


def test_empty_missing_and_unreadable_files(tmp_path):
    (tmp_path / "empty.jpg").write_bytes(b"")
    assert reason_of(tmp_path / "empty.jpg") == "empty file"
    assert reason_of(b"") == "empty file"
    assert reason_of(tmp_path / "nope.jpg") == "file not found"
    assert reason_of(str(tmp_path)) == "unreadable file"


def test_corrupt_data():
    assert reason_of(b"this is not an image at all") == "corrupt or unrecognised image data"
    png = bytearray(encode(noise(), "PNG"))
    png[60:120] = b"\x00" * 60  # damage the compressed pixel data, keep the length
    assert reason_of(bytes(png)) == "corrupt or unrecognised image data"


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_data_is_refused_not_padded(fmt):
    data = encode(noise(), fmt)
    assert reason_of(data[: len(data) // 2]) == "truncated image data"
    # refusing must not rely on (or change) PIL's process-wide switch
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_decompression_bomb_refused_from_the_header(tmp_path, monkeypatch):
    bomb = tmp_path / "bomb.png"
    Image.new("1", (12000, 12000)).save(bomb)
    assert bomb.stat().st_size < 100_000  # small on disk, 144 Mpx decoded
    decoded = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(1) or real_load(self))

    with pytest.raises(BadImage) as info:
        decode_image(bomb)
    assert str(info.value) == f"decompression bomb: 12000x12000 px > limit {Image.MAX_IMAGE_PIXELS}"
    assert decoded == []  # refused before a single pixel was decoded
    decode_image(encode(Image.new("RGB", (4, 4)), "PNG"))
    assert decoded  # the probe does see decoding


def test_max_pixels_is_configurable():
    data = encode(Image.new("RGB", (40, 30)), "PNG")
    assert str(pytest.raises(BadImage, decode_image, data, max_pixels=1000).value) == (
        "decompression bomb: 40x30 px > limit 1000"
    )
    assert decode_image(data, max_pixels=1200).image.size == (40, 30)


def test_pil_own_bomb_error_becomes_bad_image(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    # PIL refuses above twice its limit whatever max_pixels says
    assert reason_of(encode(Image.new("RGB", (20, 20)), "PNG"), max_pixels=10**9) == "decompression bomb"


def test_zero_size_image(monkeypatch):
    # Current Pillow refuses such files itself; older ones hand back an empty image.
    monkeypatch.setattr(Image, "open", lambda fp: Image.new("RGB", (0, 4)))
    assert reason_of(b"anything") == "zero-size image"


# --------------------------------------------------------------------------- conversions


def test_cmyk_converted_and_noted():
    decoded = decode_image(encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG"))
    assert decoded.note == "CMYK converted to RGB"
    r, g, b = decoded.image.getpixel((4, 4))
    assert r > 240 and g < 15 and b < 15  # CMYK (0, 100%, 100%, 0) is red


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_16_bit_grayscale_is_scaled_not_clipped(fmt):
    values = np.array([[0, 257, 1000, 32896, 40000, 65535]], dtype=np.uint16)
    decoded = decode_image(encode(Image.fromarray(values), fmt))
    assert decoded.note == "16-bit grayscale scaled to 8-bit"
    got = pixels(decoded.image)
    assert (got[..., 0] == got[..., 2]).all()
    assert got[0, :, 0].tolist() == [0, 1, 4, 128, 156, 255]  # round(v / 257); PIL alone gives 255s


def test_big_endian_16_bit():
    values = np.array([[0, 514, 65535]], dtype=">u2")
    decoded = decode_image(encode(Image.fromarray(values), "TIFF"))
    assert pixels(decoded.image)[0, :, 0].tolist() == [0, 2, 255]


def test_32_bit_grayscale_beyond_16_bits_is_min_max_scaled():
    values = np.array([[-10, 0, 100_000]], dtype=np.int32)
    decoded = decode_image(encode(Image.fromarray(values), "TIFF"))
    assert decoded.note == "32-bit grayscale min-max scaled to 8-bit"
    assert pixels(decoded.image)[0, :, 0].tolist() == [0, round(10 * 255 / 100_010), 255]


@pytest.mark.parametrize(
    ("values", "expected"),
    [([0.0, 0.5, 1.0], [0, 128, 255]), ([-2.0, 0.0, 2.0], [0, 128, 255])],
)
def test_float_grayscale(values, expected):
    decoded = decode_image(encode(Image.fromarray(np.array([values], dtype=np.float32)), "TIFF"))
    assert decoded.note == "float grayscale scaled to 8-bit"
    assert pixels(decoded.image)[0, :, 0].tolist() == expected


def palette_image(transparent: bool) -> bytes:
    image = Image.new("P", (4, 4), 0)
    image.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)  # index 0 red, 1 blue
    image.putpixel((1, 1), 1)
    return encode(image, "PNG", **({"transparency": 0} if transparent else {}))


def test_palette_with_transparency_composited_on_white():
    decoded = decode_image(palette_image(transparent=True))
    assert decoded.note == "palette transparency composited on white"
    assert decoded.image.getpixel((0, 0)) == (255, 255, 255)  # transparent red -> white
    assert decoded.image.getpixel((1, 1)) == (0, 0, 255)


def test_palette_without_transparency_is_a_plain_lookup():
    decoded = decode_image(palette_image(transparent=False))
    assert decoded.note is None
    assert decoded.image.getpixel((0, 0)) == (255, 0, 0)


def test_alpha_composited_on_white_only_when_used():
    half = decode_image(encode(Image.new("RGBA", (2, 2), (255, 0, 0, 128)), "PNG"))
    assert half.note == "transparency composited on white"
    assert half.image.getpixel((0, 0)) == (255, 127, 127)
    gray_alpha = decode_image(encode(Image.new("LA", (2, 2), (0, 0)), "PNG"))
    assert gray_alpha.image.getpixel((0, 0)) == (255, 255, 255)
    opaque = decode_image(encode(Image.new("RGBA", (2, 2), (1, 2, 3, 255)), "PNG"))
    assert (opaque.note, opaque.image.getpixel((0, 0))) == (None, (1, 2, 3))


@pytest.mark.parametrize("mode, value, expected", [("L", 77, (77, 77, 77)), ("1", 1, (255, 255, 255))])
def test_gray_and_bilevel_become_rgb_silently(mode, value, expected):
    decoded = decode_image(encode(Image.new(mode, (3, 3), value), "PNG"))
    assert (decoded.note, decoded.image.mode, decoded.image.getpixel((1, 1))) == (None, "RGB", expected)


def test_skip_policy_refuses_unusual_modes_only():
    cmyk = encode(Image.new("CMYK", (4, 4), (0, 0, 0, 0)), "JPEG")
    with pytest.raises(BadImage) as info:
        decode_image(cmyk, unusual="skip")
    assert info.value.reason == "unusual image mode" and "CMYK" in info.value.detail
    assert decode_image(encode(Image.new("L", (4, 4)), "PNG"), unusual="skip").note is None
    with pytest.raises(ValueError, match="unusual"):
        decode_image(cmyk, unusual="drop")


# --------------------------------------------------------------------------- captions


@pytest.mark.parametrize(
    ("raw", "reason", "detail"),
    [
        (None, "caption is not text", "NoneType"),
        (math.nan, "caption is not text", "float"),
        (42, "caption is not text", "int"),
        (["a cat"], "caption is not text", "list"),
        (b"a cat", "caption is not text", "bytes"),
        ("", "empty caption", ""),
        (" \t\n ", "empty caption", ""),
        ("a cat\x00\x01", "binary data in caption", "character U+0000"),
        ("\x1b[31mred cat", "binary data in caption", "character U+001B"),
        ("a cat \udc9f", "binary data in caption", "character U+DC9F"),
        ("1234 -- 56!", "caption has no letters", "'1234 -- 56!'"),
    ],
)
def test_bad_captions(raw, reason, detail):
    with pytest.raises(BadCaption) as info:
        validate_caption(raw)
    assert (info.value.reason, info.value.detail) == (reason, detail)


def test_bad_caption_message():
    assert str(pytest.raises(BadCaption, validate_caption, 3.5).value) == "caption is not text: float"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("  a red cube left of a ball \n", "a red cube left of a ball"),
        ("two\nlines\tand a tab", "two\nlines\tand a tab"),
        ("赤い立方体", "赤い立方体"),
        ("3 cats", "3 cats"),
    ],
)
def test_good_captions(raw, expected):
    assert validate_caption(raw) == expected
