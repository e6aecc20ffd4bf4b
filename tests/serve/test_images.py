"""Image-to-video over HTTP on a real one-rank server: the same bytes as ``headmoe generate
--image`` for the image sent as a multipart file and as a JSON data URL, and every hostile
image or image field refused with its status and field (issue 18)."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest

from headmoe.pipeline.image import MAX_IMAGE_BYTES
from headmoe.serve import images
from headmoe.serve.validate import RequestError
from tests.serve.conftest import I2V_IMAGE
from tests.serve.server import REQUEST, Server, finished, wait_for

PNG = I2V_IMAGE.read_bytes()
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_cache):
    srv = Server(tmp_path_factory.mktemp("i2v"), tiny_cache)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def _form(request: dict) -> dict[str, str]:
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in request.items()}


def _run(client, **kw) -> dict:
    r = client.post("/v1/videos", **kw)
    assert r.status_code == 200, r.text
    done = wait_for(client, r.json()["id"], finished)
    assert done["status"] == "completed", done
    return done


def test_multipart_and_data_url_give_generates_bytes(client, i2v_reference, reference):
    multipart = _run(client, data=_form(REQUEST),
                     files={"input_reference": ("fox.png", PNG, "image/png")})
    data_url = _run(client, json={**REQUEST, "image": DATA_URL})
    for done in (multipart, data_url):
        assert (done["video_sha256"], done["audio_sha256"]) == i2v_reference
        assert done["image"]["sha256"] == hashlib.sha256(PNG).hexdigest()
        assert (done["image"]["width"], done["image"]["height"]) == (96, 32)
    assert i2v_reference != reference  # the image conditions the output


def _refused(client, status: int, param: str | None, match: str, **kw) -> None:
    r = client.post("/v1/videos", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and match in err["message"], err


@pytest.mark.parametrize(
    ("data", "status", "match"),
    [
        (b"", 422, "is empty (0 bytes)"),
        (b"not a picture at all", 422, "is not an image"),
        (PNG[:-30], 422, "truncated or corrupt"),
        (b"GIF89a" + b"\0" * 40, 422, "GIF image"),
        (PNG + b"\0" * (MAX_IMAGE_BYTES + 1 - len(PNG)), 413, "more than the"),
    ],
    ids=["empty", "text", "truncated", "gif", "byte-cap"],
)
def test_hostile_uploads(client, data, status, match):
    _refused(client, status, "input_reference", match, data=_form(REQUEST),
             files={"input_reference": ("x.png", data, "image/png")})


def test_hostile_fields(client):
    # a path is never opened: not as a data URL, not as a form field
    _refused(client, 422, "image", "must be a data URL", json={**REQUEST, "image": str(I2V_IMAGE)})
    _refused(client, 422, "input_reference", "must be a file part", data=_form(REQUEST),
             files={"input_reference": (None, str(I2V_IMAGE))})  # a text part
    _refused(client, 422, "image", "not valid base64",
             json={**REQUEST, "image": "data:image/png;base64,@@@@"})
    _refused(client, 422, "photo", "unknown file field",
             data=_form(REQUEST), files={"photo": ("x.png", PNG, "image/png")})
    _refused(client, 422, "seed", "seed", data={**_form(REQUEST), "seed": "many"},
             files={"input_reference": ("x.png", PNG, "image/png")})


def test_data_url_over_the_cap_refused_before_decoding():
    with pytest.raises(RequestError) as exc:
        images.decode_data_url("data:image/png;base64," + "A" * (images.MAX_IMAGE_FIELD + 4))
    assert exc.value.status == 413 and exc.value.param == "image"


def test_form_values():
    assert images._form_value("seed", "42") == 42
    assert images._form_value("guidance_scale", "4.5") == 4.5
    assert images._form_value("prompt", "42") == "42"
    assert images._form_value("seed", "[1]") == "[1]"  # left for validation to name
    raw, data = images.split_json_image(json.dumps({"prompt": "x", "image": DATA_URL}).encode())
    assert json.loads(raw) == {"prompt": "x"} and data == PNG
    assert images.split_json_image(b"[1]") == (b"[1]", None)
