"""The I2V reference image: golden preprocessing (golden/magi2_pipeline section (d)) and every
hostile image, each refused by name before anything runs (issue 18 point 5)."""

from __future__ import annotations

import io
import struct
import threading
import time
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from headmoe.pipeline import image as im
from headmoe.pipeline import image_worker as iw
from tests.pipeline.goldens import golden_file

#: compares against golden/ (run under both CPU dispatches by tests/test_golden_dispatch.py)
pytestmark = pytest.mark.golden

NAME = "magi2_pipeline"
IMAGES = ("landscape_37x23", "portrait_20x50")
SIZES = ((256, 448), (64, 96))


@pytest.fixture(scope="module")
def golden():
    return load_file(golden_file(NAME, "image_preprocess.safetensors"))


def _png_bytes(name: str) -> bytes:
    return golden_file(NAME, f"images/{name}.png").read_bytes()


@pytest.mark.parametrize("name", IMAGES)
def test_golden_source_decodes_exactly(golden, name):
    rgb, facts = im.open_image(_png_bytes(name))
    assert torch.equal(torch.from_numpy(np.asarray(rgb).copy()), golden[f"{name}.source"])
    assert facts["frames"] == 1 and facts["format"] == "PNG"


@pytest.mark.parametrize("name", IMAGES)
@pytest.mark.parametrize("size", SIZES)
def test_golden_preprocessing_exact(golden, name, size):
    h, w = size
    key = f"{name}.h{h}_w{w}"
    rgb, _ = im.open_image(_png_bytes(name))
    tw, th = im.target_size(*rgb.size, max(h, w))
    pad = im.resize_and_pad(rgb, tw, th)
    assert torch.equal(torch.from_numpy(np.asarray(pad).copy()), golden[f"{key}.resizepad"])
    ref = im.prepare_image(_png_bytes(name), h, w)
    assert torch.equal(ref.pixels_uint8(), golden[f"{key}.preprocess_resized"])
    assert torch.equal(ref.vae_input(), golden[f"{key}.pixels"])  # bitwise
    assert list(ref.latent_size) == golden[f"{key}.lengths"][0, 0].tolist()


def test_describe_round_trip():
    ref = im.prepare_image(_png_bytes(IMAGES[0]), 64, 96)
    back = im.ReferenceImage.from_dict(ref.describe())
    assert back == ref and back.pixels is None and "pixels" not in ref.describe()
    with pytest.raises(RuntimeError, match="description only"):
        back.vae_input()


# ---------------------------------------------------------------------- hostile images
def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _gradient(mode: str = "RGB", size=(40, 24)) -> Image.Image:
    w, h = size
    arr = np.zeros((h, w, 3), dtype=np.uint8)
    arr[..., 0] = np.arange(w)[None] * 6
    arr[..., 1] = np.arange(h)[:, None] * 10
    arr[..., 2] = 200
    return Image.fromarray(arr).convert(mode)


def _png_header(w: int, h: int, idat: bytes = b"") -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat)
            + chunk(b"IEND", b""))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty"),
        (b"hello, this is text and not a picture", "not an image"),
        (_encode(_gradient(), "GIF"), "GIF image; use PNG, JPEG or WebP"),
        (_encode(_gradient(), "BMP"), "BMP image"),
        (_png_header(0, 5), "size 0x5"),
        (_png_header(9000, 9000), "9000x9000 = 81000000 pixels.*refused before decoding"),
        (_png_header(100_000, 100_000), "too large.*refused before decoding"),
        (_encode(_gradient(), "PNG")[:-40], "truncated or corrupt"),
        (_encode(_gradient(size=(400, 240)), "JPEG")[:-400], "truncated or corrupt"),
        (_encode(_gradient(), "JPEG")[:300], "damaged JPEG file"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 30, "damaged PNG file"),
    ],
    ids=["empty", "text", "gif", "bmp", "zero-size", "pixel-cap", "bomb", "truncated-png",
         "truncated-jpeg", "damaged-jpeg-header", "damaged-png-header"],
)
def test_hostile_images_refused(data, match):
    with pytest.raises(im.ImageError, match=match):
        im.prepare_image(data, 64, 96)


def test_byte_cap_refused_as_too_large():
    data = _encode(_gradient(), "PNG")
    big = data + b"\0" * (im.MAX_IMAGE_BYTES + 1 - len(data))
    with pytest.raises(im.ImageTooLarge, match=f"more than the {im.MAX_IMAGE_BYTES}"):
        im.prepare_image(big, 64, 96)


def test_elongated_image_refused():
    data = _encode(_gradient(size=(400, 4)), "PNG")
    with pytest.raises(im.ImageError, match=r"400x4.*96x0.*>= 32"):
        im.prepare_image(data, 64, 96)


def test_read_image_names_the_path(tmp_path):
    with pytest.raises(im.ImageError, match="--image .*missing.png.*cannot be read"):
        iw.read_image(str(tmp_path / "missing.png"), 64, 96)
    with pytest.raises(im.ImageError, match="not a regular file"):
        iw.read_image(str(tmp_path), 64, 96)


def _animated(fmt: str) -> bytes:
    frames = [Image.new("RGB", (32, 32), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, fmt, save_all=True, append_images=frames[1:], duration=100,
                   **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_animated_uses_first_frame(fmt):
    rgb, facts = im.open_image(_animated(fmt))
    assert facts["frames"] == 2 and facts["format"] == fmt
    assert rgb.getpixel((5, 5)) == (255, 0, 0)  # frame 0, as the release's load_image


def _with_orientation(img: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _encode(img, "JPEG", exif=exif.tobytes(), quality=95)


def _modes() -> dict[str, bytes]:
    rgba = _gradient("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(rgba.size))
    pal = _gradient().convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    arr16 = (np.arange(24 * 40, dtype=np.uint16).reshape(24, 40) * 60)
    return {
        "rgba-png": _encode(rgba, "PNG"),
        "la-png": _encode(rgba.convert("LA"), "PNG"),
        "palette-png": _encode(pal, "PNG", transparency=3),
        "gray16-png": _encode(Image.frombytes("I;16", (40, 24), arr16.tobytes()), "PNG"),
        "cmyk-jpeg": _encode(_gradient("CMYK"), "JPEG", quality=95),
        "gray-jpeg": _encode(_gradient("L"), "JPEG"),
        "exif-rotated-jpeg": _with_orientation(_gradient(size=(40, 24)), 6),
        "rgba-webp": _encode(rgba, "WEBP", lossless=True),
    }


KINDS = ("rgba-png", "la-png", "palette-png", "gray16-png", "cmyk-jpeg", "gray-jpeg",
         "exif-rotated-jpeg", "rgba-webp")


def test_every_mode_case_listed():
    assert sorted(KINDS) == sorted(_modes())


@pytest.mark.parametrize("kind", KINDS)
def test_modes_handled_as_the_release(kind, tmp_path):
    """16-bit, CMYK, palette, alpha and EXIF-rotated images open exactly as the release's
    ``diffusers.utils.load_image`` opens them (its file path API)."""
    from diffusers.utils import load_image

    data = _modes()[kind]
    path = tmp_path / "img"
    path.write_bytes(data)
    ours, _ = im.open_image(data)
    ref = load_image(str(path))
    assert ours.mode == ref.mode == "RGB" and ours.size == ref.size
    assert np.array_equal(np.asarray(ours), np.asarray(ref))
    if kind == "exif-rotated-jpeg":
        assert ours.size == (24, 40)  # orientation 6: rotated a quarter turn


# ------------------------------------------- bounded decoding (issue 32 points 1 and 2)
#: a 38-byte lossless WebP of 8192 x 8192 pixels (one colour; Pillow's encoder, method 0)
WEBP_8K = bytes.fromhex("524946461e000000574542505650384c110000002fffdfff070750e42ad4a3ff"
                        "8188e87f0000")


def many_scans_jpeg(scans: int) -> bytes:
    """A progressive JPEG whose last scan is repeated up to ``scans`` scans (each one more
    pass over the whole image for the decoder)."""
    data = _encode(_gradient(size=(64, 48)), "JPEG", progressive=True)
    last = data.rindex(b"\xff\xda")
    extra = scans - data.count(b"\xff\xda")
    return data[:-2] + data[last:-2] * extra + b"\xff\xd9"


def many_chunks_png(chunks: int) -> bytes:
    """A valid PNG with ``chunks`` empty private ancillary chunks before its image data."""
    data = _encode(_gradient(), "PNG")
    empty = struct.pack(">I", 0) + b"zzZz" + struct.pack(">I", zlib.crc32(b"zzZz"))
    at = 8 + 25  # after the signature and IHDR
    return data[:at] + empty * chunks + data[at:]


def test_declared_size_past_the_decode_budget_refused_before_decoding():
    with pytest.raises(im.ImageError, match=r"8192x8192: decoding it needs about 768 MiB, "
                                            r"more than the 256 MiB.*before decoding"):
        im.prepare_image(WEBP_8K, 64, 96)
    with pytest.raises(im.ImageError, match=r"6000x6000.*more than the 256 MiB"):
        im.prepare_image(_png_header(6000, 6000), 64, 96)


def test_large_jpeg_decodes_at_reduced_size():
    big = _encode(Image.new("RGB", (5000, 5000), (20, 120, 220)), "JPEG")
    assert im.decode_bytes(5000, 5000) > im.MAX_DECODE_BYTES
    ref = im.prepare_image(big, 64, 96)
    assert ref.source_size == (625, 625)  # 1/8: still covers the 96-pixel target
    assert (ref.width, ref.height) == (96, 96)


def test_scan_and_chunk_counts_refused_before_decoding():
    start = time.monotonic()
    with pytest.raises(im.ImageError, match=f"JPEG of 5000 scans, more than the "
                                            f"{im.MAX_JPEG_SCANS}"):
        im.prepare_image(many_scans_jpeg(5000), 64, 96)
    with pytest.raises(im.ImageError, match=f"PNG of more than {im.MAX_PNG_CHUNKS} chunks"):
        im.prepare_image(many_chunks_png(im.MAX_PNG_CHUNKS + 1), 64, 96)
    assert time.monotonic() - start < 2
    # under the limits both decode
    assert im.prepare_image(many_scans_jpeg(im.MAX_JPEG_SCANS), 64, 96).width == 96
    assert im.prepare_image(many_chunks_png(100), 64, 96).width == 96


def test_isolated_decode_matches_and_is_bounded_in_time():
    from headmoe.pipeline import image_worker as iw

    data = _png_bytes(IMAGES[0])
    ref = iw.prepare_isolated(data, 64, 96)
    assert ref == im.prepare_image(data, 64, 96) and ref.pixels == im.prepare_image(
        data, 64, 96).pixels
    with pytest.raises(im.ImageError, match="took more than 0.001 s to decode"):
        iw.prepare_isolated(data, 64, 96, timeout_s=0.001)
    gone = threading.Event()
    gone.set()
    with pytest.raises(iw.ImageCancelled, match="cancelled"):
        iw.prepare_isolated(data, 64, 96, cancelled=gone)
    with pytest.raises(im.ImageError, match="decoding it needs about 768 MiB"):
        iw.prepare_isolated(WEBP_8K, 64, 96)
    with pytest.raises(im.ImageTooLarge):  # checked before any child starts
        iw.prepare_isolated(b"\0" * (im.MAX_IMAGE_BYTES + 1), 64, 96)


def test_decoder_child_imports_no_torch():
    import subprocess
    import sys

    from headmoe.pipeline import image_worker as iw

    code = iw._CHILD.replace("sys.exit(main(sys.argv[1:]))", "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr
