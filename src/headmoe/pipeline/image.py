"""The image-to-video reference image: opening, checking and preprocessing (MAGI2.md 9.2).

`open_image` (for a file: `headmoe.pipeline.image_worker.read_image`) turns untrusted
bytes into an RGB ``PIL.Image`` exactly as the release opens its ``--image`` (diffusers'
``load_image``: EXIF orientation applied, then ``convert("RGB")``: alpha is dropped, not
composited; palette, 16-bit, CMYK and grayscale images go through Pillow's own
conversion), after these checks, each a `ImageError` naming the problem:

- at most `MAX_IMAGE_BYTES` bytes, and not empty;
- a PNG, JPEG or WebP file (`FORMATS`), recognised by Pillow from its header;
- width and height >= 1 and ``width x height <= MAX_IMAGE_PIXELS``, read from the header
  before any pixel is decoded (decompression bombs are refused without decoding them);
- the whole image decodes (a truncated or corrupt file is refused, never padded);
- an animated file (APNG, animated WebP) is accepted and its **first frame** is used, as
  the release does (``Image.open`` leaves frame 0 current); `ReferenceImage.frames` records
  how many it had.

`prepare_image` then applies the release's geometry for a request of ``height x width``:

1. target size: the long side becomes ``max(height, width)``, the short side
   ``int(short * max / long)`` (truncated);
2. resize-and-pad (`resize_and_pad`): scale by ``min(target_w / W, target_h / H)``, resize
   to ``max(1, round(W s)) x max(1, round(H s))`` with PIL LANCZOS, paste at
   ``((tw - w') // 2, (th - h') // 2)`` on a **white** canvas (the golden data; MAGI2.md's
   "black" is wrong);
3. the video processor's resize: both sides floored to a multiple of `PIXEL_MULTIPLE` (32)
   and resized again with LANCZOS (aspect not kept); a side that floors below 32 is refused.

The result keeps the uint8 pixels ``[H32, W32, 3]``; `ReferenceImage.vae_input` gives the
encoder's ``[1, 3, 1, H32, W32]`` float32 in [-1, 1] (``u8 / 255 * 2 - 1``). Reference
numbers: ``golden/magi2_pipeline/`` section (d), checked by tests/pipeline/test_image.py.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, NotRequired, TypedDict, cast

import numpy as np

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image as PILImage

#: the largest image file accepted (bytes)
MAX_IMAGE_BYTES = 32 << 20
#: the largest image accepted (width x height from the header, before decoding)
MAX_IMAGE_PIXELS = 8192 * 8192
#: the most bytes a decode may hold: the decoded image in its own mode plus its RGB copy,
#: estimated from the header before decoding (a JPEG past it is decoded at reduced size,
#: Pillow's draft mode, when that brings it under; anything else is refused)
MAX_DECODE_BYTES = 256 << 20
#: scans of a JPEG at most (SOS markers; a progressive JPEG has about 10), before decoding
MAX_JPEG_SCANS = 100
#: chunks of a PNG at most (a 32 MiB file in 8 KiB IDAT chunks has 4,096), before decoding
MAX_PNG_CHUNKS = 10_000
#: the file formats accepted (Pillow's names)
FORMATS = ("PNG", "JPEG", "WEBP")
#: both sides of the VAE input are floored to a multiple of this (2 x the VAE stride 16)
PIXEL_MULTIPLE = 32


class ImageError(ValueError):
    """A refused image; the message names the problem (and ``what``, the image's name)."""


class ImageTooLarge(ImageError):
    """More bytes than `MAX_IMAGE_BYTES` (HTTP 413)."""


class ImageFacts(TypedDict):
    """What `open_image` reads of a file (the `ReferenceImage` fields it sets)."""

    sha256: str
    bytes: int
    format: str
    mode: str
    frames: int
    source_size: NotRequired[tuple[int, int]]
    """Set once the image has decoded."""


class ImageDescription(TypedDict):
    """`ReferenceImage.describe`: every field but the pixels, ``source_size`` as a list."""

    sha256: str
    bytes: int
    source_size: list[int]
    format: str
    mode: str
    frames: int
    long_side: int
    height: int
    width: int


@dataclass(frozen=True)
class ReferenceImage:
    """An opened, checked and preprocessed reference image.

    ``sha256`` / ``bytes`` of the file; ``source_size`` its ``(width, height)`` after EXIF
    orientation; ``format`` / ``mode`` Pillow's; ``frames`` the frames in the file (frame 0
    is used); ``height`` / ``width`` the preprocessed size (multiples of 32) for a request
    whose long side is ``long_side``; ``pixels`` the preprocessed RGB bytes, uint8
    ``[height, width, 3]`` row-major, or None where only the description travelled (a serve
    rank other than the encoder's)."""

    sha256: str
    bytes: int
    source_size: tuple[int, int]
    format: str
    mode: str
    frames: int
    long_side: int
    height: int
    width: int
    # builtins.: the field ``bytes`` above shadows the type in the class body
    pixels: builtins.bytes | None = field(default=None, repr=False, compare=False)

    @property
    def latent_size(self) -> tuple[int, int]:
        """``(h, w)`` of the encoded latent: the preprocessed size / 16."""
        return self.height // 16, self.width // 16

    def describe(self) -> ImageDescription:
        """What the sidecar and the ranks' JSON carry (everything but the pixels)."""
        d = asdict(self)
        d.pop("pixels")
        d["source_size"] = list(self.source_size)
        return cast(ImageDescription, d)  # asdict's keys are the fields

    @classmethod
    def from_dict(cls, d: ImageDescription) -> ReferenceImage:
        """Inverse of `describe` (no pixels)."""
        fields: dict[str, object] = {**d, "source_size": tuple(d["source_size"])}
        return cls(**fields)  # type: ignore[arg-type]  # describe()'s keys: every field but pixels

    def pixels_uint8(self) -> torch.Tensor:
        """``[height, width, 3]`` uint8 (a copy)."""
        import torch  # not at the top: the decoding child imports this module without torch

        if self.pixels is None:
            raise RuntimeError("this rank holds the image's description only, not its pixels")
        arr = np.frombuffer(self.pixels, dtype=np.uint8).reshape(self.height, self.width, 3)
        return torch.from_numpy(arr.copy())

    def vae_input(self) -> torch.Tensor:
        """``[1, 3, 1, height, width]`` float32 in [-1, 1]: ``u8 / 255 * 2 - 1`` (as the
        release's video processor computes it, bit for bit)."""
        x = self.pixels_uint8().float() / 255.0
        return (2.0 * x - 1.0).permute(2, 0, 1)[None, :, None].contiguous()


#: leading bytes of the formats accepted and of a few others (named in the refusal)
MAGIC = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF8": "GIF", b"BM": "BMP",
         b"II*\x00": "TIFF", b"MM\x00*": "TIFF", b"\x00\x00\x01\x00": "ICO"}


def sniff(data: bytes) -> str | None:
    """The format named by the file's first bytes (`MAGIC`, and ``RIFF....WEBP``), or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((name for magic, name in MAGIC.items() if data.startswith(magic)), None)


def _unidentified(data: bytes, what: str) -> ImageError:
    """Why Pillow could not open ``data``, as precisely as its first bytes tell."""
    kind = sniff(data)
    if kind is None:
        return ImageError(f"{what} is not an image (expected PNG, JPEG or WebP)")
    if kind not in FORMATS:
        return ImageError(f"{what} is a {kind} image; use PNG, JPEG or WebP")
    if kind == "PNG" and data[12:16] == b"IHDR":
        w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        if w == 0 or h == 0:
            return ImageError(f"{what} has size {w}x{h}; an image needs at least 1x1 pixels")
    return ImageError(f"{what} is a damaged {kind} file (its header cannot be read)")


def _check_header(img: PILImage, what: str) -> None:
    _check_size(*img.size, what)


def _check_size(w: int, h: int, what: str) -> None:
    if w < 1 or h < 1:
        raise ImageError(f"{what} has size {w}x{h}; an image needs at least 1x1 pixels")
    if w * h > MAX_IMAGE_PIXELS:
        raise ImageError(f"{what} is {w}x{h} = {w * h} pixels, more than the "
                         f"{MAX_IMAGE_PIXELS} accepted (refused before decoding)")


def png_chunks(data: bytes, limit: int) -> int:
    """The chunks of a PNG file, counted up to ``limit + 1`` (stops at ``IEND``)."""
    pos, count = 8, 0
    while pos + 8 <= len(data) and count <= limit:
        count += 1
        if data[pos + 4:pos + 8] == b"IEND":
            break
        pos += 12 + int.from_bytes(data[pos:pos + 4], "big")
    return count


def webp_size(data: bytes) -> tuple[int, int] | None:
    """The canvas ``(width, height)`` a WebP file's first chunk declares (VP8X, VP8L or
    VP8), or None. Read here because Pillow's WebP reader allocates the canvas on open."""
    kind, body = data[12:16], data[20:30]
    if kind == b"VP8X" and len(body) >= 10:
        return 1 + int.from_bytes(body[4:7], "little"), 1 + int.from_bytes(body[7:10], "little")
    if kind == b"VP8L" and len(body) >= 5 and body[0] == 0x2F:
        bits = int.from_bytes(body[1:5], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if kind == b"VP8 " and len(body) >= 10 and body[3:6] == b"\x9d\x01\x2a":
        return (int.from_bytes(body[6:8], "little") & 0x3FFF,
                int.from_bytes(body[8:10], "little") & 0x3FFF)
    return None


def check_structure(data: bytes, what: str) -> None:
    """Refuse, before decoding (before Pillow opens the file), a JPEG of more than
    `MAX_JPEG_SCANS` scans (its SOS markers; each scan is one more pass over the whole
    image), a PNG of more than `MAX_PNG_CHUNKS` chunks, or a WebP whose declared canvas is
    past `MAX_IMAGE_PIXELS` or `MAX_DECODE_BYTES`."""
    kind = sniff(data)
    if kind == "WEBP" and (size := webp_size(data)) is not None:
        _check_size(*size, what)
        if decode_bytes(*size) > MAX_DECODE_BYTES:
            raise _over_budget(size, size, what)
    if kind == "JPEG" and (scans := data.count(b"\xff\xda")) > MAX_JPEG_SCANS:
        raise ImageError(f"{what} is a JPEG of {scans} scans, more than the "
                         f"{MAX_JPEG_SCANS} accepted (refused before decoding)")
    if kind == "PNG" and png_chunks(data, MAX_PNG_CHUNKS) > MAX_PNG_CHUNKS:
        raise ImageError(f"{what} is a PNG of more than {MAX_PNG_CHUNKS} chunks "
                         "(refused before decoding)")


def decode_bytes(width: int, height: int) -> int:
    """The bytes a decode of ``width x height`` holds at most: Pillow's 4 bytes a pixel for
    the image, its RGB copy and an EXIF-rotated copy."""
    return 12 * width * height


def _check_decode_budget(img: PILImage, what: str, long_side: int | None) -> None:
    """Refuse an image whose decode would pass `MAX_DECODE_BYTES`; a JPEG is first set to
    decode at the smallest scale (1/2, 1/4, 1/8) that still covers the target size of
    ``long_side``, which changes its pixels, so only an image past the budget gets it."""
    w, h = img.size
    if decode_bytes(w, h) <= MAX_DECODE_BYTES:
        return
    if img.format == "JPEG" and long_side is not None:
        img.draft("RGB", target_size(w, h, long_side))
        if decode_bytes(*img.size) <= MAX_DECODE_BYTES:
            return
    raise _over_budget((w, h), img.size, what)


def _over_budget(size: tuple[int, int], decoded: tuple[int, int], what: str) -> ImageError:
    return ImageError(f"{what} is {size[0]}x{size[1]}: decoding it needs about "
                      f"{decode_bytes(*decoded) >> 20} MiB, more than the "
                      f"{MAX_DECODE_BYTES >> 20} MiB accepted (refused before decoding)")


def check_bytes(data: object, what: str) -> None:
    """The file-level checks: bytes, not empty, at most `MAX_IMAGE_BYTES` (`ImageTooLarge`)."""
    if not isinstance(data, bytes | bytearray):
        raise ImageError(f"{what} must be bytes, got {type(data).__name__}")
    if not data:
        raise ImageError(f"{what} is empty (0 bytes)")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageTooLarge(f"{what} has {len(data)} bytes, more than the {MAX_IMAGE_BYTES} "
                            "accepted")


def open_image(data: bytes, what: str = "the image", long_side: int | None = None
               ) -> tuple[PILImage, ImageFacts]:
    """``(RGB PIL image, facts)`` of the file ``data`` after every check of the module doc;
    facts: ``sha256``, ``bytes``, ``format``, ``mode``, ``frames``, ``source_size`` (of the
    decode: a JPEG past `MAX_DECODE_BYTES` decodes at reduced size for ``long_side``).
    Raises `ImageError` (`ImageTooLarge` over the byte cap) naming the problem."""
    from PIL import Image, ImageOps

    check_bytes(data, what)
    check_structure(data, what)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"{what} is too large ({exc}); refused before decoding") from None
    except Exception:  # noqa: BLE001 - Pillow raises many kinds for unknown data
        raise _unidentified(bytes(data[:32]), what) from None
    _check_header(img, what)
    fmt = cast(str, img.format)  # one of FORMATS: Image.open(formats=FORMATS) names it
    facts: ImageFacts = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                         "format": fmt, "mode": img.mode,
                         "frames": int(getattr(img, "n_frames", 1))}
    _check_decode_budget(img, what, long_side)
    try:
        img.load()  # frame 0; a truncated file raises here
        rgb = ImageOps.exif_transpose(img).convert("RGB")
    except Exception as exc:  # noqa: BLE001
        raise ImageError(f"{what} cannot be decoded: it is truncated or corrupt "
                         f"({type(exc).__name__}: {exc})") from None
    facts["source_size"] = rgb.size
    return rgb, facts


def target_size(width: int, height: int, long_side: int) -> tuple[int, int]:
    """``(target_w, target_h)`` for an image of ``width x height``: the long side scaled
    to ``long_side``, the other ``int(side * long_side / long)`` (the release's rule; ties
    scale the height)."""
    if width > height:
        return long_side, int(height * long_side / width)
    return int(width * long_side / height), long_side


def resize_and_pad(img: PILImage, target_w: int, target_h: int) -> PILImage:
    """The release's ``_resizepad``: keep the aspect, LANCZOS, centred on white."""
    from PIL import Image

    w, h = img.size
    scale = min(target_w / w, target_h / h)
    new_w, new_h = max(1, round(w * scale)), max(1, round(h * scale))
    resized = img.resize((new_w, new_h), Image.Resampling.LANCZOS)
    canvas = Image.new("RGB", (target_w, target_h), (255, 255, 255))
    canvas.paste(resized, ((target_w - new_w) // 2, (target_h - new_h) // 2))
    return canvas


def vae_size(target_w: int, target_h: int) -> tuple[int, int]:
    """Both sides floored to a multiple of `PIXEL_MULTIPLE`."""
    return target_w - target_w % PIXEL_MULTIPLE, target_h - target_h % PIXEL_MULTIPLE


def max_latent_size(height: int, width: int) -> tuple[int, int]:
    """The largest ``(h, w)`` latent any image can give for a request of ``height x width``
    (a square one: both sides ``max(height, width)`` floored to 32, / 16), for the memory
    estimate before the image is read."""
    side = vae_size(max(height, width), 0)[0] // 16
    return side, side


def prepare_image(data: bytes, height: int, width: int, what: str = "the image"
                  ) -> ReferenceImage:
    """Open (`open_image`) and preprocess ``data`` for a request of ``height x width``
    (module doc steps 1-3). Raises `ImageError` naming the problem, including an aspect
    ratio so extreme that a side floors below 32 pixels."""
    from PIL import Image

    long_side = max(height, width)
    rgb, facts = open_image(data, what, long_side)
    tw, th = target_size(*rgb.size, long_side)
    vw, vh = vae_size(tw, th)
    if vw < PIXEL_MULTIPLE or vh < PIXEL_MULTIPLE:
        sw, sh = rgb.size
        raise ImageError(
            f"{what} is {sw}x{sh}: at a long side of {long_side} pixels it becomes {tw}x{th}, "
            f"and the encoder needs both sides >= {PIXEL_MULTIPLE}; use a less elongated "
            "image or a larger height/width")
    padded = resize_and_pad(rgb, tw, th)
    final = padded.resize((vw, vh), Image.Resampling.LANCZOS)
    pixels = np.asarray(final, dtype=np.uint8)
    return ReferenceImage(**facts, long_side=long_side, height=vh, width=vw,
                          pixels=pixels.tobytes())

