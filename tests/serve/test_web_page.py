"""The web page at ``/`` (`headmoe.serve.page`) in a real browser: Playwright driving
Debian's Chromium headless against one ``headmoe serve --api-key`` on the embedded tiny
release. The page asks for the key, builds its presets from ``GET /v1/models``, shows the
API's own error words, submits a text job and an image job (dropped on the page), moves
their progress bars, plays each finished video (its duration read through the page) with
its hashes and a download link, and lists the past jobs. A missing browser fails the test
(`CHROMIUM`; `.ci/run` installs Debian's ``chromium``), it never skips.

The screenshot of the finished page is written to a temporary file; with
``HEADMOE_WEB_SCREENSHOT=PATH`` it is also copied to PATH (``scripts/web_screenshot.sh``
regenerates docs/web-page.png that way)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect, sync_playwright

from headmoe.serve.page import CONTENT_SECURITY_POLICY
from tests.goldens import REPO
from tests.serve.conftest import I2V_IMAGE
from tests.serve.server import Server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
KEY = "web-page-test-key"
SCREENSHOT = REPO / "docs" / "web-page.png"
#: the page's uncaught exceptions and Content-Security-Policy violations
PAGE_ERRORS: list[str] = []
#: records every value a progress bar of the job list takes, per job id (run before the
#: page's own script; Playwright's init scripts are not subject to the page's CSP)
WATCH_PROGRESS = """
window.seenProgress = {};
new MutationObserver((records) => {
  for (const r of records) {
    const item = r.target.closest && r.target.closest("#jobs li");
    if (r.target.tagName !== "PROGRESS" || !item) continue;
    (window.seenProgress[item.dataset.id] ||= []).push(Number(r.target.getAttribute("value")));
  }
}).observe(document, {subtree: true, attributes: true, attributeFilter: ["value"]});
"""
#: resolves once the player's video has its metadata: its source, duration and what it is
VIDEO_METADATA = """(path) => new Promise((resolve, reject) => {
  const v = document.getElementById("video");
  const done = () => resolve({src: v.src, content: v.dataset.content, duration: v.duration,
                              width: v.videoWidth, height: v.videoHeight});
  v.addEventListener("error", () => reject(new Error("video error " + v.error.message)));
  if (v.dataset.content === path && v.readyState >= 1) done();
  else v.addEventListener("loadedmetadata", done, {once: true});
})"""

#: the player seeks to the clip's middle and resolves once that frame is shown (for the
#: screenshot)
SHOW_A_FRAME = """() => new Promise((resolve) => {
  const v = document.getElementById("video");
  v.addEventListener("seeked", () => requestAnimationFrame(() => resolve()), {once: true});
  v.currentTime = v.duration / 2;
})"""


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_cache):
    srv = Server(tmp_path_factory.mktemp("web"), tiny_cache, "--api-key", KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api(server):
    with server.client(KEY) as c:
        yield c


@pytest.fixture(scope="module")
def page(server):
    assert CHROMIUM.is_file(), (f"{CHROMIUM} is missing: the browser test needs Debian's "
                                "chromium package (apt-get install -y chromium; .ci/run does)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        context.add_init_script(WATCH_PROGRESS)
        page = context.new_page()
        page.set_default_timeout(120_000)
        page.on("pageerror", lambda e: PAGE_ERRORS.append(str(e)))
        page.on("console", lambda m: "Content Security Policy" in m.text
                and PAGE_ERRORS.append(m.text))
        yield page
        browser.close()


def _submit(page: Page) -> str:
    """Click Generate; the id of the job the page's POST made."""
    with page.expect_response(lambda r: r.url.endswith("/v1/videos")
                              and r.request.method == "POST") as posted:
        page.click("#submit")
    assert posted.value.status == 200, posted.value.text()
    return str(posted.value.json()["id"])


def _played(page: Page, api, job_id: str) -> dict:
    """Wait for ``job_id`` to complete and play in the page; check the player against the
    API's job. Returns the job."""
    path = f"/v1/videos/{job_id}/content"
    with page.expect_response(lambda r: r.url.endswith(path)) as content:
        page.wait_for_function("(p) => document.getElementById('video').dataset.content === p",
                               arg=path)
    assert content.value.status == 200 and content.value.headers["content-type"] == "video/mp4"
    job = api.get(f"/v1/videos/{job_id}").json()
    assert job["status"] == "completed", job
    meta = page.evaluate(VIDEO_METADATA, path)
    assert meta["src"].startswith("blob:" + page.url.rstrip("/")), meta
    # the clip is num_frames / fps long (the muxer's audio ends within a frame of it)
    assert abs(meta["duration"] - job["seconds"]) <= 1 / job["request"]["fps"], (meta, job)
    assert f"{meta['width']}x{meta['height']}" == job["size"], (meta, job)
    expect(page.locator("#video-sha256")).to_have_text(job["video_sha256"])
    expect(page.locator("#audio-sha256")).to_have_text(job["audio_sha256"])
    link = page.locator("#download")
    assert link.get_attribute("href") == meta["src"]
    assert link.get_attribute("download") == f"{job_id}.mp4"
    # the page fetched the server's whole file (the blob: URL itself is out of the page's
    # connect-src, so it is not read again here)
    assert int(content.value.headers["content-length"]) == len(api.get(path).content) > 0
    seen = page.evaluate("(id) => window.seenProgress[id] || []", job_id)
    assert any(0 < v < 100 for v in seen) and seen[-1] == 100, seen  # the bar moved
    assert seen == sorted(seen), seen
    return job


def test_page_headers_and_no_inline_script(server):
    import httpx

    html = httpx.get(server.url + "/").raise_for_status()  # the page needs no key
    assert html.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe" not in CONTENT_SECURITY_POLICY
    assert html.text.count("<script") == 1 and '<script src="/web/app.js" defer></script>' in html.text
    links = re.findall(r'(?:src|href)="([^"]*)"', html.text)
    assert links and all(u.startswith(("/", "data:", "#")) for u in links), links  # no CDN
    js = httpx.get(server.url + "/web/app.js").raise_for_status()
    assert js.headers["content-type"].startswith("text/javascript")
    assert httpx.get(server.url + "/v1/models").status_code == 401  # the API still needs it
    serving = " ".join((REPO / "docs" / "serving.md").read_text().split())
    assert CONTENT_SECURITY_POLICY in serving.replace("`", "")  # the doc states it


def test_key_presets_and_api_errors(page: Page, server, api):
    page.goto(server.url + "/")
    unauthorised = api.get("/v1/models", headers={"Authorization": "Bearer wrong"}).json()
    expect(page.locator("#banner")).to_have_text(unauthorised["error"]["message"])
    page.fill("#api-key", KEY)
    page.click("#save-key")
    expect(page.locator("#banner")).to_be_hidden()
    model = api.get("/v1/models").json()["data"][0]
    options = page.locator("#resolution option")
    expect(options).to_have_count(len(model["resolutions"]) + 2)
    values = [options.nth(i).get_attribute("value") for i in range(options.count())]
    assert values == ["", *model["resolutions"], "custom"], values
    assert "1080p" in model["resolutions"]  # the tiny release has refiner/
    for field, name in (("#seed", "seed"), ("#steps", "num_inference_steps")):
        expect(page.locator(field)).to_have_attribute("placeholder", str(model["defaults"][name]))
    # an error shown as the API words it
    page.fill("#prompt", "x")
    page.select_option("#resolution", "custom")
    page.fill("#width", "50")
    page.fill("#height", "32")
    page.click("#submit")
    expected = api.post("/v1/videos", json={"prompt": "x", "size": "50x32"}).json()
    expect(page.locator("#form-error")).to_have_text(expected["error"]["message"])
    assert "50" in expected["error"]["message"]
    assert PAGE_ERRORS == []  # no exception, no CSP violation


def test_text_and_image_jobs_play_in_the_page(page: Page, server, api, tmp_path):
    page.goto(server.url + "/")
    page.fill("#api-key", KEY)
    page.click("#save-key")
    expect(page.locator("#resolution option[value=custom]")).to_have_count(1)
    page.fill("#prompt", "a red fox running through snow at dusk")
    page.fill("#negative-prompt", "blur")
    page.fill("#seed", "5")
    page.fill("#steps", "6")
    page.fill("#seconds", "1")
    page.select_option("#resolution", "custom")
    page.fill("#width", "64")
    page.fill("#height", "32")
    text = _played(page, api, _submit(page))
    assert text["request"]["seed"] == 5 and text["num_inference_steps"] == 6
    assert text["size"] == "64x32" and text["request"]["num_frames"] == 9  # 4k+1 <= 12.5
    assert text["image"] is None and text["request"]["negative_prompt"] == "blur"

    # the image job: the file dropped on the drop zone, the model's default size
    page.select_option("#resolution", "")
    page.fill("#seconds", "0.5")
    drop = page.evaluate_handle(
        """(bytes) => { const dt = new DataTransfer();
                        dt.items.add(new File([new Uint8Array(bytes)], "fox.png",
                                              {type: "image/png"}));
                        return dt; }""", list(I2V_IMAGE.read_bytes()))
    page.dispatch_event("#drop", "drop", {"dataTransfer": drop})
    expect(page.locator("#image-preview")).to_be_visible()
    image = _played(page, api, _submit(page))
    assert image["image"]["sha256"] == hashlib.sha256(I2V_IMAGE.read_bytes()).hexdigest()
    assert image["request"]["num_frames"] == 5 and image["request"]["seed"] == 5

    # the list of past jobs, newest first, both completed
    items = page.locator("#jobs li")
    ids = [items.nth(i).get_attribute("data-id") for i in range(items.count())]
    assert ids[:2] == [image["id"], text["id"]], ids
    for job_id in ids[:2]:
        expect(page.locator(f'#jobs li[data-id="{job_id}"] .status')).to_have_text("completed")
    expect(page.locator("#jobs li.playing")).to_have_attribute("data-id", image["id"])
    assert PAGE_ERRORS == []
    page.evaluate(SHOW_A_FRAME)
    shot = tmp_path / "web-page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert _png_size(shot)[0] == 1280
    if target := os.environ.get("HEADMOE_WEB_SCREENSHOT"):
        shutil.copyfile(shot, target)
    assert SCREENSHOT.is_file() and _png_size(SCREENSHOT)[0] == 1280, SCREENSHOT


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG file (its IHDR chunk)."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    width, height = struct.unpack(">II", head[16:24])
    return width, height
