// The try-a-voice page of `mizuoto serve`: plain browser APIs (fetch streams, Web Audio), no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const CLONING = ["clone", "cross_lingual"];  // modes that speak a clip (instruct alone may take presets only)
const page = { models: [], listing: 0, ctx: null, analyser: null, sources: [], playAt: 0, abort: null, monitor: null };
// The last synthesis, for the curious (in the console) and for the browser test.
window.mizuotoStats = null;

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON: fall through */ }
  return `${response.status} ${response.statusText}`;
}

// Every request of the page goes through here: the API key field, when filled, goes with it as
// `Authorization: Bearer <key>` (to this server only; the key lives in the field, nowhere else).
async function api(path, options = {}) {
  const key = $("api-key").value.trim();
  const headers = new Headers(options.headers || {});
  if (key) {
    try { headers.set("Authorization", `Bearer ${key}`); } catch (e) {
      throw keyError("the API key has characters an HTTP header cannot carry: check the API key field");
    }
  }
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) {
    throw keyError(key ? "the server refused this API key (401): check the API key field above"
      : "this server needs an API key (401): type it in the API key field above");
  }
  $("api-key").removeAttribute("aria-invalid");
  if (!response.ok) throw new Error(await errorText(response));
  return response;
}

function keyError(message) {
  $("api-key").setAttribute("aria-invalid", "true");
  const error = new Error(message);
  error.key = true;
  return error;
}

async function getJson(path, options) {
  return (await api(path, options)).json();
}

function showError(message) {
  $("error").textContent = message || "";
  $("error").hidden = !message;
}

function setStatus(text) { $("status").textContent = text; }

function currentModel() { return page.models.find((m) => m.id === $("model").value); }

async function loadModels() {
  // an alias (--alias) names a model listed in its own right: the menu shows each model once
  page.models = (await getJson("/v1/models")).data.filter((m) => !m.alias_of);
  $("model").replaceChildren(...page.models.map(
    (m) => new Option(m.loaded ? `${m.id} (${m.engine})` : `${m.id} (not loaded)`, m.id)));
  await loadVoices();
}

async function loadVoices(select) {
  const model = currentModel();
  if (!model) { $("voice").replaceChildren(); return; }
  const clones = (model.modes || []).some((m) => CLONING.includes(m));
  const voices = (await getJson(`/v1/audio/voices?model=${encodeURIComponent(model.id)}`)).data
    .filter((v) => v.model === model.id || (clones && v.kind === "uploaded"));
  const options = voices.map((v) => new Option(voiceLabel(v), v.id));
  if (!options.length) options.push(new Option(clones ? "(choose a reference clip below)" : "(default)", ""));
  $("voice").replaceChildren(...options);
  if (select) $("voice").value = select;
  $("model-info").textContent = model.loaded
    ? `${model.engine}${model.variant ? " " + model.variant : ""}, ${model.sample_rate} Hz; modes: ${model.modes.join(", ")}`
    : "not loaded now: it loads on first use";
  $("clone").hidden = model.loaded && !clones;
  $("instruct-row").hidden = !(model.modes || []).includes("instruct");
  showOptions(model.options || []);
}

// What a voice is, said plainly: only a voice stored on the server is "saved" (it survives a restart).
function voiceLabel(v) {
  if (v.kind === "uploaded") return `${v.id} (uploaded: until the server restarts)`;
  if (v.kind === "cached") return v.stored ? `${v.id} (saved)` : `${v.id} (cached: until the server restarts)`;
  return v.id;
}

// The figures, the waveform and the download belong to the last synthesis: cleared when it no longer applies.
function resetFigures() {
  for (const id of ["first-chunk", "rtf", "audio-seconds", "chunks"]) $(id).textContent = "-";
  $("download").hidden = true;
  drawWaveform(null);
  window.mizuotoStats = null;
}

// The whole result as a waveform: each column of the canvas spans the lowest to the highest sample it covers.
function drawWaveform(samples) {
  const canvas = $("waveform");
  const g = canvas.getContext("2d");
  const { width, height } = canvas;
  g.clearRect(0, 0, width, height);
  if (!samples || !samples.length) return;
  g.fillStyle = "#2f6fb3";
  const per = samples.length / width;
  for (let x = 0; x < width; x++) {
    let lo = 1, hi = -1;
    const end = Math.min(samples.length, Math.max(Math.floor((x + 1) * per), Math.floor(x * per) + 1));
    for (let i = Math.floor(x * per); i < end; i++) {
      const s = Math.max(-1, Math.min(1, samples[i]));
      if (s < lo) lo = s;
      if (s > hi) hi = s;
    }
    if (lo > hi) continue;
    const top = (1 - hi) * height / 2, bottom = (1 - lo) * height / 2;
    g.fillRect(x, top, 1, Math.max(1, bottom - top));
  }
}

function joined(pieces) {
  const out = new Float32Array(pieces.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of pieces) { out.set(p, at); at += p.length; }
  return out;
}

// One field per request option the model's engine declares (GET /v1/models lists them as JSON schemas).
function showOptions(options) {
  $("options").replaceChildren(...options.map((o) => {
    const label = document.createElement("label");
    label.title = o.description || "";
    let input;
    if (o.enum) {
      input = document.createElement("select");
      input.replaceChildren(...o.enum.map((v) => new Option(v, v)));
    } else {
      input = document.createElement("input");
      input.type = o.type === "boolean" ? "checkbox" : o.type === "string" ? "text" : "number";
      if (o.type === "number") input.step = "any";
      if (o.minimum !== undefined) input.min = o.minimum;
      if (o.maximum !== undefined) input.max = o.maximum;
    }
    if (o.type === "boolean") input.checked = o.default; else input.value = o.default;
    input.dataset.option = o.name;
    input.dataset.type = o.type;
    input.dataset.default = String(o.default);
    label.append(`${o.name} `, input);
    return label;
  }));
}

// The options set off their defaults (the server fills in the rest).
function optionValues() {
  const out = {};
  for (const input of $("options").querySelectorAll("[data-option]")) {
    const { option, type } = input.dataset;
    const value = type === "boolean" ? input.checked
      : type === "number" || type === "integer" ? Number(input.value) : input.value;
    if (String(value) !== input.dataset.default && input.value !== "") out[option] = value;
  }
  return out;
}

function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function audioContext() {
  if (!page.ctx) {
    page.ctx = new AudioContext();
    page.analyser = page.ctx.createAnalyser();
    page.analyser.fftSize = 2048;
    page.analyser.connect(page.ctx.destination);
  }
  page.ctx.resume();
  return page.ctx;
}

function schedule(samples, rate) {
  const ctx = page.ctx;
  const buffer = ctx.createBuffer(1, samples.length, rate);
  buffer.copyToChannel(samples, 0);
  const source = ctx.createBufferSource();
  source.buffer = buffer;
  source.connect(page.analyser);
  // A little lead on the first piece, then back to back: gapless while the stream keeps ahead.
  const at = Math.max(ctx.currentTime + 0.05, page.playAt);
  source.start(at);
  page.playAt = at + buffer.duration;
  page.sources.push(source);
}

// Watches what actually plays (the analyser sits between the sources and the speakers).
function watchPlayback(stats, finished) {
  const frame = new Float32Array(page.analyser.fftSize);
  stats.playedPeak = 0;
  clearInterval(page.monitor);
  page.monitor = setInterval(() => {
    page.analyser.getFloatTimeDomainData(frame);
    for (const x of frame) stats.playedPeak = Math.max(stats.playedPeak, Math.abs(x));
    if (stats.received && page.ctx.currentTime > page.playAt + 0.1) {
      clearInterval(page.monitor);
      finished();
    }
  }, 20);
}

function stopPlayback() {
  if (page.abort) page.abort.abort();
  for (const s of page.sources) { try { s.stop(); } catch (e) { /* not started */ } }
  page.sources = [];
  clearInterval(page.monitor);
  if (page.ctx) page.playAt = page.ctx.currentTime;
}

function wavBlob(parts, rate) {
  const size = parts.reduce((n, p) => n + p.length, 0);
  const header = new DataView(new ArrayBuffer(44));
  const text = (at, s) => [...s].forEach((c, i) => header.setUint8(at + i, c.charCodeAt(0)));
  text(0, "RIFF"); header.setUint32(4, 36 + size, true); text(8, "WAVEfmt ");
  header.setUint32(16, 16, true); header.setUint16(20, 1, true); header.setUint16(22, 1, true);
  header.setUint32(24, rate, true); header.setUint32(28, rate * 2, true); header.setUint16(32, 2, true);
  header.setUint16(34, 16, true); text(36, "data"); header.setUint32(40, size, true);
  return new Blob([header, ...parts], { type: "audio/wav" });
}

async function requestBody() {
  const body = { model: $("model").value, input: $("text").value, stream_format: "audio", response_format: "pcm" };
  const file = $("ref-file").files[0];
  if (file) {
    body.ref_audio = await readDataUrl(file);
    if ($("ref-text").value.trim()) body.ref_text = $("ref-text").value.trim();
  } else if ($("voice").value) {
    body.voice = $("voice").value;
  }
  if ($("speed").value !== "" && Number($("speed").value) !== 1) body.speed = Number($("speed").value);
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if (!$("instruct-row").hidden && $("instruct").value.trim()) body.instructions = $("instruct").value.trim();
  const options = optionValues();
  if (Object.keys(options).length) body.options = options;
  return body;
}

function setBusy(busy) {
  $("speak").disabled = busy;
  $("stop").disabled = !busy;
}

async function speak(event) {
  event.preventDefault();
  showError("");
  stopPlayback();
  resetFigures();
  const ctx = audioContext();
  const stats = { firstChunkMs: null, rtf: null, seconds: 0, chunks: 0, rate: 0, rms: 0, received: false };
  window.mizuotoStats = stats;
  const controller = new AbortController();
  page.abort = controller;
  setBusy(true);
  setStatus("requesting...");
  let sumSquares = 0, samples = 0, carry = null;
  const parts = [], decoded = [];
  try {
    const body = await requestBody();
    const started = performance.now();
    const response = await api("/v1/audio/speech", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    stats.rate = parseInt(response.headers.get("X-Sample-Rate"), 10);
    const reader = response.body.getReader();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      let bytes = value;
      if (carry) { bytes = new Uint8Array([...carry, ...value]); carry = null; }
      if (bytes.length % 2) { carry = bytes.slice(-1); bytes = bytes.slice(0, -1); }
      if (!bytes.length) continue;
      if (stats.firstChunkMs === null) {
        stats.firstChunkMs = performance.now() - started;
        $("first-chunk").textContent = `${stats.firstChunkMs.toFixed(0)} ms`;
        setStatus("streaming...");
        watchPlayback(stats, () => { setStatus("done"); setBusy(false); });
      }
      const pcm = new Int16Array(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.length));
      const floats = Float32Array.from(pcm, (x) => x / 32768);
      for (const x of floats) sumSquares += x * x;
      samples += floats.length;
      parts.push(new Uint8Array(pcm.buffer));
      decoded.push(floats);
      schedule(floats, stats.rate);
      stats.chunks += 1;
      $("chunks").textContent = String(stats.chunks);
    }
    if (!samples) throw new Error("the server sent no audio");
    stats.seconds = samples / stats.rate;
    stats.rtf = (performance.now() - started) / 1000 / stats.seconds;
    stats.rms = Math.sqrt(sumSquares / samples);
    stats.received = true;
    $("rtf").textContent = `${stats.rtf.toFixed(3)} (${stats.rtf < 1 ? "faster" : "slower"} than real time)`;
    $("audio-seconds").textContent = `${stats.seconds.toFixed(2)} s at ${stats.rate} Hz`;
    $("download-link").href = URL.createObjectURL(wavBlob(parts, stats.rate));
    drawWaveform(joined(decoded));
    $("download").hidden = false;
    setStatus("playing...");
  } catch (e) {
    clearInterval(page.monitor);
    setBusy(false);
    if (e.name === "AbortError") { setStatus("stopped"); return; }
    setStatus("failed");
    showError(e.message);
  }
}

async function saveVoice() {
  showError("");
  const file = $("ref-file").files[0];
  if (!file) { showError("choose a reference clip to upload first"); return; }
  const form = new FormData();
  form.append("id", $("voice-id").value.trim());
  if ($("ref-text").value.trim()) form.append("text", $("ref-text").value.trim());
  form.append("file", file);
  try {
    const voice = await getJson("/v1/audio/voices", { method: "POST", body: form });
    $("ref-file").value = "";
    await loadVoices(voice.id);
    setStatus(`uploaded voice ${voice.id} (until the server restarts)`);
  } catch (e) {
    showError(e.message);
  }
}

// (Re)lists the models: on load, and whenever the API key changes; only the latest listing reports.
function listModels() {
  const run = ++page.listing;
  showError("");
  setStatus("listing the models...");
  return loadModels().then(() => { if (run === page.listing) setStatus("ready"); }).catch((e) => {
    if (run !== page.listing) return;
    setStatus("no models");
    showError(e.key ? e.message : `could not list the models: ${e.message}`);
  });
}

document.addEventListener("DOMContentLoaded", () => {
  $("speak-form").addEventListener("submit", speak);
  $("stop").addEventListener("click", () => { stopPlayback(); setBusy(false); setStatus("stopped"); });
  $("model").addEventListener("change", () => { resetFigures(); loadVoices().catch((e) => showError(e.message)); });
  $("save-voice").addEventListener("click", saveVoice);
  $("api-key").addEventListener("change", listModels);
  listModels();
});
