// The web page of `headmoe serve` (headmoe/serve/page.py): a client of the server's HTTP
// API, nothing more. Every API call sends the key typed in the page as
// "Authorization: Bearer <key>"; every error shown is the API's own message.
"use strict";

const POLL_BUSY_MS = 250;   // while a job is queued or running
const POLL_IDLE_MS = 2000;  // otherwise
const KEY_STORE = "headmoe-api-key";
const $ = (id) => document.getElementById(id);

let apiKey = sessionStorage.getItem(KEY_STORE) || "";
let image = null;          // the File to send as input_reference
let imageUrl = null;       // its preview's blob: URL
let videoUrl = null;       // the playing video's blob: URL
let playing = null;        // the id of the job in the player
const awaited = new Set(); // jobs submitted from this page: played when completed
let pollTimer = null;
let pollRound = 0;         // a newer round of polling (a new key) ends the older one

class ApiError extends Error {}

// ------------------------------------------------------------------ API
async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  if (apiKey) headers.set("Authorization", `Bearer ${apiKey}`);
  let response;
  try {
    response = await fetch(path, { ...options, headers });
  } catch (exc) {
    throw new ApiError(`the server did not answer (${exc.message})`);
  }
  if (!response.ok) throw new ApiError(await errorMessage(response));
  return response;
}

async function errorMessage(response) {
  // the API's error shape: {"error": {"message", "type", "param", "code"}}
  const text = await response.text();
  try {
    const message = JSON.parse(text).error.message;
    if (typeof message === "string") return message;
  } catch (exc) { /* not the error shape: show the status */ }
  return `HTTP ${response.status}: ${text.slice(0, 200)}`;
}

function show(element, message) {
  element.textContent = message || "";
  element.hidden = !message;
}

// ------------------------------------------------------------------ the form
function fillModel(model) {
  $("model").textContent = `model ${model.id}`;
  const d = model.defaults;
  $("negative-prompt").placeholder = d.negative_prompt;
  $("seed").placeholder = d.seed;
  $("steps").placeholder = d.num_inference_steps;
  $("seconds").placeholder = +d.seconds.toFixed(3);
  $("width").placeholder = d.width;
  $("height").placeholder = d.height;
  const select = $("resolution");
  select.replaceChildren(new Option(`model default (${d.size})`, ""));
  for (const [name, size] of Object.entries(model.resolutions)) {
    select.add(new Option(`${name} (${size})`, name));
  }
  select.add(new Option("custom size", "custom"));
  $("drop").hidden = !model.image;
}

function formFields() {
  const fields = { prompt: $("prompt").value };
  const text = { negative_prompt: "negative-prompt" };
  const numbers = { seed: "seed", num_inference_steps: "steps", seconds: "seconds" };
  for (const [name, id] of Object.entries(text)) {
    if ($(id).value !== "") fields[name] = $(id).value;
  }
  for (const [name, id] of Object.entries(numbers)) {
    if ($(id).value.trim() !== "") fields[name] = numberOf($(id));
  }
  const preset = $("resolution").value;
  if (preset === "custom") fields.size = `${$("width").value}x${$("height").value}`;
  else if (preset) fields.resolution = preset;
  return fields;
}

function numberOf(input) {
  // what was typed, as a number when it reads as one (the API names a bad value itself)
  const value = Number(input.value);
  return Number.isFinite(value) ? value : input.value;
}

function requestBody(fields) {
  if (!image) {
    return { body: JSON.stringify(fields), headers: { "Content-Type": "application/json" } };
  }
  const form = new FormData();
  for (const [name, value] of Object.entries(fields)) form.append(name, String(value));
  form.append("input_reference", image, image.name);
  return { body: form };
}

async function submit(event) {
  event.preventDefault();
  show($("form-error"), "");
  $("submit").disabled = true;
  try {
    const response = await api("/v1/videos", { method: "POST", ...requestBody(formFields()) });
    const job = await response.json();
    awaited.add(job.id);
    await poll(); // polls at the busy pace from now on
  } catch (exc) {
    show($("form-error"), exc.message);
  } finally {
    $("submit").disabled = false;
  }
}

function sizeChanged() {
  const custom = $("resolution").value === "custom";
  for (const id of ["width", "height"]) {
    $(id).disabled = !custom;
    if (custom && $(id).value === "") $(id).value = $(id).placeholder;
  }
}

// ------------------------------------------------------------------ the image
function setImage(file) {
  if (imageUrl) URL.revokeObjectURL(imageUrl);
  image = file || null;
  imageUrl = image ? URL.createObjectURL(image) : null;
  const preview = $("image-preview");
  preview.hidden = !image;
  if (image) preview.src = imageUrl; else preview.removeAttribute("src");
  $("clear-image").hidden = !image;
  $("drop-text").textContent = image ? `Image: ${image.name}` : "Image (optional): drop it here or";
  if (!image) $("image").value = "";
}

function bindDrop() {
  const zone = $("drop");
  for (const name of ["dragenter", "dragover"]) {
    zone.addEventListener(name, (e) => { e.preventDefault(); zone.classList.add("over"); });
  }
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("over");
    if (e.dataTransfer.files.length) setImage(e.dataTransfer.files[0]);
  });
  $("image").addEventListener("change", () => setImage($("image").files[0]));
  $("clear-image").addEventListener("click", () => setImage(null));
}

// ------------------------------------------------------------------ the list of jobs
function jobItem(job) {
  let item = document.querySelector(`#jobs li[data-id="${job.id}"]`);
  if (item) return item;
  item = document.createElement("li");
  item.dataset.id = job.id;
  const head = document.createElement("div");
  head.className = "head";
  for (const cls of ["status", "prompt", "meta"]) {
    const span = document.createElement("span");
    span.className = cls;
    head.append(span);
  }
  const bar = document.createElement("progress");
  bar.max = 100;
  const error = document.createElement("p");
  error.className = "error";
  const actions = document.createElement("div");
  actions.className = "actions";
  item.append(head, bar, error, actions);
  return item;
}

function button(label, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.addEventListener("click", onClick);
  return b;
}

function renderJob(job) {
  const item = jobItem(job);
  item.dataset.status = job.status;
  item.classList.toggle("playing", job.id === playing);
  item.querySelector(".status").textContent = job.status.replace("_", " ");
  item.querySelector(".prompt").textContent = job.request.prompt;
  const image = job.image ? ", image" : "";
  item.querySelector(".meta").textContent =
    `${job.size}, ${+job.seconds.toFixed(3)} s, ${job.num_inference_steps} steps${image}`;
  const bar = item.querySelector("progress");
  if (bar.value !== job.progress) bar.value = job.progress;
  bar.textContent = `${job.progress}%`;
  show(item.querySelector(".error"), job.error ? job.error.message : "");
  const actions = [];
  if (job.status === "completed") actions.push(button("Play", () => play(job)));
  if (job.status === "queued" || job.status === "in_progress") {
    actions.push(button("Cancel", () => cancel(job.id)));
  }
  item.querySelector(".actions").replaceChildren(...actions);
  return item;
}

function renderJobs(jobs) {
  const list = $("jobs");
  const items = jobs.slice().reverse().map(renderJob); // newest first
  list.replaceChildren(...items);
}

async function cancel(id) {
  try {
    await api(`/v1/videos/${id}`, { method: "DELETE" });
    await refresh();
  } catch (exc) {
    show($("banner"), exc.message);
  }
}

// ------------------------------------------------------------------ the player
async function play(job) {
  const path = `/v1/videos/${job.id}/content`;
  try {
    const blob = await (await api(path)).blob();
    if (videoUrl) URL.revokeObjectURL(videoUrl);
    videoUrl = URL.createObjectURL(blob);
    playing = job.id;
    for (const item of $("jobs").children) {
      item.classList.toggle("playing", item.dataset.id === playing);
    }
    const video = $("video");
    video.dataset.content = path;
    video.src = videoUrl;
    $("player-id").textContent = job.id;
    $("video-sha256").textContent = job.video_sha256;
    $("audio-sha256").textContent = job.audio_sha256;
    $("video-seed").textContent = job.seed;
    $("video-size").textContent = job.size;
    $("video-seconds").textContent = +job.seconds.toFixed(3);
    const link = $("download");
    link.href = videoUrl;
    link.download = `${job.id}.mp4`;
    $("player").hidden = false;
  } catch (exc) {
    show($("banner"), exc.message);
  }
}

// ------------------------------------------------------------------ polling
async function refresh() {
  let jobs;
  try {
    jobs = (await (await api("/v1/videos")).json()).data;
  } catch (exc) {
    show($("banner"), exc.message);
    return false;
  }
  show($("banner"), "");
  renderJobs(jobs);
  for (const job of jobs) {
    if (awaited.has(job.id) && job.status !== "queued" && job.status !== "in_progress") {
      awaited.delete(job.id);
      if (job.status === "completed") await play(job);
    }
  }
  return jobs.some((j) => j.status === "queued" || j.status === "in_progress");
}

async function poll(round = ++pollRound) {
  clearTimeout(pollTimer);
  const busy = await refresh();
  if (round !== pollRound) return;
  pollTimer = setTimeout(() => poll(round), busy ? POLL_BUSY_MS : POLL_IDLE_MS);
}

async function loadModel() {
  try {
    const models = (await (await api("/v1/models")).json()).data;
    fillModel(models[0]);
    return true;
  } catch (exc) {
    show($("banner"), exc.message);
    return false;
  }
}

async function start() {
  if (await loadModel()) await poll();
}

function init() {
  $("api-key").value = apiKey;
  $("save-key").addEventListener("click", () => {
    apiKey = $("api-key").value.trim();
    sessionStorage.setItem(KEY_STORE, apiKey);
    start();
  });
  $("create").addEventListener("submit", submit);
  $("resolution").addEventListener("change", sizeChanged);
  bindDrop();
  start();
}

document.addEventListener("DOMContentLoaded", init);
