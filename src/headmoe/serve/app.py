"""The FastAPI application of ``headmoe serve`` over rank 0's `JobStore`.

Endpoints (JSON unless stated; errors are ``{"error": {"message", "type", "param",
"code"}}``):

- ``POST /v1/videos``: validate (`headmoe.serve.validate`) and queue; the job object,
  ``status: "queued"``. 400 malformed body, 413 too large (body, or an image over its byte
  cap), 422 a bad field (named with its value), 429 queue full, 503 draining. JSON, or
  ``multipart/form-data`` with an image-to-video file in ``input_reference``; a JSON body
  carries the image as a base64 data URL in ``image`` (`headmoe.serve.images`).
- ``POST /v1/videos/sync``: the same, then waits and returns the mp4 (``video/mp4``, headers
  ``X-Video-Id``, ``X-Video-Sha256``, ``X-Audio-Sha256``); a failed job gives 500, a
  cancelled one 409.
- ``GET /v1/videos``: ``{"object": "list", "data": [job, ...]}`` in submission order.
- ``GET /v1/videos/{id}``: the job (404 unknown id).
- ``GET /v1/videos/{id}/content``: the mp4 (404 until completed, 410 once its file is gone).
- ``DELETE /v1/videos/{id}``: cancel a queued or in-progress job (the job object); for a
  finished job delete it and its files (``{"id", "object": "video.deleted", "deleted"}``).
- ``GET /v1/models``: ``{"object": "list", "data": [model]}``, the served model's
  `ServeSpec.model_card` (its presets and defaults).
- ``GET /`` (no key needed): the web page (`headmoe.serve.page`), on this API.
- ``GET /health`` (never authenticated): 200 ``{"status": "ok", "replicas": [...]}``
  (`JobStore.replica_view`: each data-parallel replica's ranks, state and job); 503 while
  loading or draining. ``GET /metrics``: Prometheus text (`headmoe.serve.metrics.ServerMetrics`).

With an API key every endpoint but ``/health`` and the page's files needs
``Authorization: Bearer <key>`` (401 otherwise).
"""

from __future__ import annotations

import asyncio
import hmac
import threading
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.requests import ClientDisconnect

from headmoe.serve import http, images, page
from headmoe.serve.http import BODY_TIMEOUT_S
from headmoe.serve.spec import ServeSpec
from headmoe.serve.state import Draining, Job, JobStore, QueueFull
from headmoe.serve.validate import RequestError, admit_body, parse_body

#: the largest request body read (bytes)
MAX_BODY = 1 << 20
def error(status: int, message: str, param: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style error response."""
    return JSONResponse(http.error_body(status, message, param), status_code=status,
                        headers=headers)


class _Refused(Exception):
    def __init__(self, response: JSONResponse):
        self.response = response


def create_app(store: JobStore, spec: ServeSpec) -> FastAPI:
    """The application; ``spec`` gives the API key and the validation rules."""
    # with a key the schema pages are off: they would answer without it
    pages = {} if spec.api_key is None else {"docs_url": None, "redoc_url": None,
                                              "openapi_url": None}
    app = FastAPI(title="headmoe serve", version="1", **pages)
    app.state.image_slots = images.ImageSlots()

    @app.exception_handler(_Refused)
    async def _refused(request: Request, exc: _Refused) -> JSONResponse:
        return exc.response

    async def auth(request: Request) -> None:
        if spec.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), spec.api_key.encode()
        ):
            store.reject(401)
            raise _Refused(error(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                 headers={"WWW-Authenticate": "Bearer"}))

    @app.get("/health")
    async def health() -> JSONResponse:
        draining = store.draining or store.signalled
        state = "draining" if draining else "ok" if store.ready else "loading"
        return JSONResponse({"status": state, "replicas": store.replica_view()},
                            status_code=200 if state == "ok" else 503)

    api = APIRouter(dependencies=[Depends(auth)])
    _add_video_routes(api, store, spec)

    @api.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [spec.model_card()]})

    app.include_router(api)
    page.add_page(app)
    return app


async def _read_body(request: Request, limit: int = MAX_BODY) -> bytes:
    """The body: at most ``limit`` bytes (413), all of it within `BODY_TIMEOUT_S` (408)."""
    declared = request.headers.get("content-length", "0")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(f"the body has {declared} bytes, more than {limit}", None, 413)
    raw = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            raw.extend(chunk)
            if len(raw) > limit:
                raise RequestError(f"the body has more than {limit} bytes", None, 413)

    try:
        await asyncio.wait_for(read(), BODY_TIMEOUT_S)
    except TimeoutError:
        raise RequestError(f"the body did not arrive within {BODY_TIMEOUT_S:g} s", None,
                           408) from None
    except ClientDisconnect:  # nobody to answer; counted, not logged as a traceback
        raise RequestError("the client went away before sending its body", None,
                           400) from None
    return bytes(raw)


async def _request_and_image(request: Request, spec: ServeSpec) -> tuple[Any, Any]:
    """The admitted request (`admit_body`) and its I2V `ReferenceImage` (or None) of a JSON
    or multipart body (`headmoe.serve.images`)."""
    raw = await _read_body(request, MAX_BODY + images.MAX_IMAGE_FIELD + (64 << 10))
    if images.is_multipart(request.headers.get("content-type", "")):
        raw, data = await images.split_multipart(request.headers, raw)
        param = images.FILE_FIELD
    else:
        raw, data = images.split_json_image(raw)
        param = images.URL_FIELD
    if len(raw) > MAX_BODY:
        raise RequestError(f"the body has more than {MAX_BODY} bytes besides its image", None,
                           413)
    admitted = admit_body(parse_body(raw), spec, image=data is not None)
    req = admitted.request
    if data is None:
        return admitted, None
    if not spec.takes_images:
        raise RequestError(f"{param}: this server's model has no image encoder (a release "
                           "folder's vae/Wan2.2_VAE.pth)", param)
    return admitted, await _decode(request, spec, data, req, param)


async def _decode(request: Request, spec: ServeSpec, data: bytes, req: Any, param: str
                  ) -> Any:
    """The request's image, decoded in a child process (`images.prepare_request_image`)
    holding one of the app's `images.ImageSlots`; the child is killed when the client goes
    away."""
    slots: images.ImageSlots = request.app.state.image_slots
    slots.take(param)
    cancelled = threading.Event()
    try:
        task = asyncio.ensure_future(run_in_threadpool(
            images.prepare_request_image, data, req.height, req.width, param, cancelled))
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                cancelled.set()
        return task.result()
    finally:
        cancelled.set()
        slots.free()


async def _submit(request: Request, store: JobStore, spec: ServeSpec) -> Job:
    try:
        admitted, image = await _request_and_image(request, spec)
        job = store.submit(admitted.request, admitted.describe(), image, admitted.refiner)
    except RequestError as exc:
        store.reject(exc.status)
        raise _Refused(error(exc.status, exc.message, exc.param, exc.headers)) from None
    except QueueFull as exc:
        store.reject(429)
        raise _Refused(error(429, str(exc))) from None
    except Draining as exc:
        store.reject(503)
        raise _Refused(error(503, str(exc))) from None
    return job


def _lookup(store: JobStore, video_id: str) -> Job:
    job = store.get(video_id)
    if job is None:
        raise _Refused(error(404, f"no video with id {video_id!r}", "id"))
    return job


def _add_video_routes(api: APIRouter, store: JobStore, spec: ServeSpec) -> None:
    @api.post("/v1/videos")
    async def create(request: Request) -> JSONResponse:
        return JSONResponse(store.view(await _submit(request, store, spec)))

    @api.post("/v1/videos/sync")
    async def create_sync(request: Request):
        job = await _submit(request, store, spec)
        while not job.done.is_set():
            await asyncio.sleep(0.05)
        if job.status == "completed":
            return _content(store, job)
        return error(500 if job.status == "failed" else 409,
                     f"video {job.id} {job.status}: {job.error}")

    @api.get("/v1/videos")
    async def list_videos() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [store.view(j) for j in store.jobs()]})

    @api.get("/v1/videos/{video_id}")
    async def retrieve(video_id: str) -> JSONResponse:
        return JSONResponse(store.view(_lookup(store, video_id)))

    @api.get("/v1/videos/{video_id}/content")
    async def content(video_id: str):
        job = _lookup(store, video_id)
        if job.status != "completed":
            return error(404, f"video {job.id} is {job.status}; its content exists once "
                              "it is completed", "id")
        return _content(store, job)

    @api.delete("/v1/videos/{video_id}")
    async def delete(video_id: str) -> JSONResponse:
        job = _lookup(store, video_id)
        if job.done.is_set():
            store.forget(job)
            return JSONResponse({"id": job.id, "object": "video.deleted", "deleted": True})
        store.cancel(job)
        return JSONResponse(store.view(job))

    @api.get("/metrics")
    async def metrics() -> Response:
        body, content_type = store.metrics.render()
        return Response(body, media_type=content_type)


def _content(store: JobStore, job: Job) -> FileResponse | JSONResponse:
    result = job.result or {}
    try:
        path = store.output_path(job.id)
    except ValueError:  # the output folder was replaced by a link out of it
        return error(410, f"video {job.id} was completed but its file is no longer in the "
                          "server's output folder", "id")
    if not path.is_file():
        return error(410, f"video {job.id} was completed but its file is gone from the "
                          "server", "id")
    return FileResponse(
        path,
        media_type="video/mp4",
        filename=f"{job.id}.mp4",
        headers={"X-Video-Id": job.id, "X-Video-Sha256": str(result.get("video_sha256")),
                 "X-Audio-Sha256": str(result.get("audio_sha256"))},
    )
