"""The image of an image-to-video ``POST /v1/videos``, in either of its two forms.

- ``multipart/form-data`` (the OpenAI / vLLM-Omni convention): the file in the part named
  ``input_reference`` and every other field a form field. Form values are text; a value
  that reads as a JSON number, ``true``/``false`` or ``null`` becomes one (so ``seed=42``
  is the integer 42), except in the text fields `TEXT_FIELDS`, which stay as sent. The
  fields then go through the same validation as a JSON body.
- ``application/json``: the image in ``image`` as a base64 data URL,
  ``data:image/<png|jpeg|webp>;base64,<data>``.

The server never opens a path named in a request: only bytes sent in the request are read.
A file over `headmoe.pipeline.image.MAX_IMAGE_BYTES` is refused with 413; so is a body whose
fields (the body less its image) exceed the JSON limit, or whose image part is too long. Every other check of `headmoe.pipeline.image` (format, header size
before decoding, truncation, ...) gives 422 naming the field (``input_reference`` or
``image``). The image is opened and preprocessed before the job is queued, in a child
process bounded in memory and time (`headmoe.pipeline.image_worker`; killed when the client
goes away), never in rank 0's HTTP process; only the preprocessed pixels travel to rank 0
(the image encoder's). At most `MAX_IMAGE_JOBS` images are decoded at once: a request past
them gets 503 with ``Retry-After: IMAGE_RETRY_AFTER_S`` (`ImageSlots`).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import threading
from collections.abc import AsyncIterator
from typing import Any

from headmoe.pipeline.image import MAX_IMAGE_BYTES, ImageError, ImageTooLarge
from headmoe.pipeline.image_worker import prepare_isolated
from headmoe.serve.validate import RequestError

#: the multipart part that carries the file
FILE_FIELD = "input_reference"
#: the JSON field that carries a data URL
URL_FIELD = "image"
#: form fields whose values are never read as JSON
TEXT_FIELDS = frozenset({"prompt", "negative_prompt", "model", "sampler", "size",
                         "resolution", "dtype", "noise_device"})
#: the base64 length of the largest image accepted (what a body may carry beyond its fields)
MAX_IMAGE_FIELD = 4 * (MAX_IMAGE_BYTES // 3 + 1)
#: images decoded at once (each in its own child process); more get 503
MAX_IMAGE_JOBS = 2
#: the ``Retry-After`` (seconds) of that 503
IMAGE_RETRY_AFTER_S = 2
_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg|webp);base64,", re.IGNORECASE)


def is_multipart(content_type: str) -> bool:
    return content_type.split(";")[0].strip().lower() == "multipart/form-data"


def split_json_image(raw: bytes) -> tuple[bytes, bytes | None]:
    """A JSON body -> (the body without ``image``, the decoded image bytes or None). A body
    that is not a JSON object is returned as is (its validation reports it)."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return raw, None
    if not isinstance(obj, dict) or URL_FIELD not in obj:
        return raw, None
    data = decode_data_url(obj.pop(URL_FIELD))
    return json.dumps(obj).encode(), data


def decode_data_url(url: Any) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URL; `RequestError` naming ``image``."""
    if not isinstance(url, str) or not _DATA_URL.match(url):
        shown = url[:40] + "..." if isinstance(url, str) and len(url) > 40 else url
        raise RequestError(f"{URL_FIELD} must be a data URL 'data:image/png;base64,...' "
                           f"(png, jpeg or webp), got {shown!r}", URL_FIELD)
    payload = url[_DATA_URL.match(url).end():]
    if len(payload) > MAX_IMAGE_FIELD:
        raise RequestError(f"{URL_FIELD} holds more than the {MAX_IMAGE_BYTES} bytes accepted",
                           URL_FIELD, 413)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{URL_FIELD} is not valid base64 after its 'data:' prefix",
                           URL_FIELD) from None


def _form_value(name: str, value: str) -> Any:
    if name in TEXT_FIELDS:
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if parsed is None or isinstance(parsed, bool | int | float) else value


async def split_multipart(headers: Any, raw: bytes) -> tuple[bytes, bytes | None]:
    """A multipart body -> (its fields as a JSON body, the ``input_reference`` bytes or
    None). Malformed multipart data is a 400; other files, or two files, are refused."""
    from starlette.datastructures import UploadFile
    from starlette.formparsers import MultiPartException, MultiPartParser

    async def body() -> AsyncIterator[bytes]:
        yield raw

    class InMemory(MultiPartParser):
        # the body is in memory already (bounded): its file part never spools to disk, so
        # a full TMPDIR cannot fail an upload
        spool_max_size = MAX_IMAGE_FIELD + 1

    try:
        form = await InMemory(headers, body(), max_files=1, max_fields=64).parse()
    except MultiPartException as exc:
        raise RequestError(f"the multipart body cannot be read: {exc.message}", None,
                           400) from None
    except OSError as exc:
        raise RequestError(f"the multipart body cannot be stored: {exc.strerror}", None,
                           503) from None
    fields, image = {}, None
    try:
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                if name != FILE_FIELD:
                    raise RequestError(f"unknown file field {name!r} (the image goes in "
                                       f"{FILE_FIELD!r})", name)
                image = await value.read()
            elif name == FILE_FIELD:
                raise RequestError(f"{FILE_FIELD} must be a file part, got a text field",
                                   FILE_FIELD)
            elif name in fields:
                raise RequestError(f"field {name!r} is given twice", name)
            else:
                fields[name] = _form_value(name, value)
    finally:
        await form.close()
    return json.dumps(fields).encode(), image


class ImageSlots:
    """At most `MAX_IMAGE_JOBS` image decodes at once (one event loop takes and frees them,
    so a counter is enough); `take` refuses with 503 + ``Retry-After`` past them."""

    def __init__(self, size: int | None = None):
        self.size, self.busy = MAX_IMAGE_JOBS if size is None else size, 0

    def take(self, param: str) -> None:
        if self.busy >= self.size:
            raise RequestError(f"{param}: {self.size} images are being decoded already; "
                               f"retry in {IMAGE_RETRY_AFTER_S} s", param, 503,
                               {"Retry-After": str(IMAGE_RETRY_AFTER_S)})
        self.busy += 1

    def free(self) -> None:
        self.busy -= 1


def prepare_request_image(data: bytes, height: int, width: int, param: str,
                          cancelled: threading.Event | None = None) -> Any:
    """`prepare_isolated` for a request of ``height x width``; refusals as `RequestError`
    (413 over the byte cap, else 422) naming ``param``."""
    try:
        return prepare_isolated(data, height, width, what=param, cancelled=cancelled)
    except ImageTooLarge as exc:
        raise RequestError(str(exc), param, 413) from None
    except ImageError as exc:
        raise RequestError(str(exc), param) from None
