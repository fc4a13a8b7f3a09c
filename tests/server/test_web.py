"""The web page at `/` of `mizuoto serve`, in a real headless Chromium (Debian's chromium and chromedriver).

The browser comes from apt (`make test` installs it); nothing is downloaded here. Each wait is
for something the page shows, bounded in time.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.ui import WebDriverWait

from mizuoto.server.page import WEB_DIR
from mizuoto.server.state import ServerConfig

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
WAIT = 60.0  # seconds for anything the page shows
API_KEY = "web-test-api-key"


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium driven by chromedriver, both from the system; audio plays without a gesture or a device."""
    for path in (CHROMIUM, CHROMEDRIVER):
        assert shutil.which(path), f"{path} is missing: apt-get install -y chromium chromium-driver (make test does)"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--autoplay-policy=no-user-gesture-required", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT)
    driver.set_script_timeout(WAIT)
    yield driver
    driver.quit()


def _open(browser, server) -> None:
    browser.get(server.url + "/")
    WebDriverWait(browser, WAIT).until(lambda d: d.find_element(By.ID, "status").text in ("ready", "failed")
                                       or d.find_element(By.ID, "error").is_displayed())
    assert browser.find_element(By.ID, "status").text == "ready", browser.find_element(By.ID, "error").text


def _speak(browser, text: str) -> dict:
    """Type `text`, press Speak, wait until it is done (failing with the page's error), return the page's stats."""
    box = browser.find_element(By.ID, "text")
    box.clear()
    box.send_keys(text)
    browser.find_element(By.ID, "speak").click()
    assert _settled(browser) == "done", browser.find_element(By.ID, "error").text
    return browser.execute_script("return window.mizuotoStats")


def _settled(browser) -> str:
    """Wait until a synthesis is done or failed; returns the status."""
    WebDriverWait(browser, WAIT).until(lambda d: d.find_element(By.ID, "status").text in ("done", "failed"))
    return browser.find_element(By.ID, "status").text


def test_page_loads_from_the_server_alone(browser, server):
    """The page lists the served models; every resource it loads comes from the server itself."""
    browser.get_log("browser")  # drop what earlier tests logged (a 401 is logged as an error)
    _open(browser, server)
    models = [o.get_attribute("value") for o in Select(browser.find_element(By.ID, "model")).options]
    assert {"piper", "cosy", "tone"} <= set(models)
    resources = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources and all(r.startswith(server.url + "/") for r in resources), resources
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_piper_synthesis_plays_audio(browser, server):
    """Piper through the page: audio streams in, plays (the analyser hears it), latency and RTF are shown."""
    _open(browser, server)
    Select(browser.find_element(By.ID, "model")).select_by_value("piper")
    WebDriverWait(browser, WAIT).until(lambda d: "piper" in d.find_element(By.ID, "model-info").text)
    stats = _speak(browser, "The browser plays this sentence. And then this one.")
    assert stats["rate"] == 22050 and stats["seconds"] > 1.0 and stats["rms"] > 0.01, stats
    assert stats["playedPeak"] > 0.05, f"the audio did not play out loud: {stats}"
    assert stats["firstChunkMs"] > 0 and stats["rtf"] > 0
    assert browser.find_element(By.ID, "first-chunk").text.endswith(" ms")
    assert browser.find_element(By.ID, "rtf").text.startswith(f"{stats['rtf']:.3f}")
    assert browser.find_element(By.ID, "download-link").get_attribute("href").startswith("blob:")


def test_bad_input_shows_the_server_message(browser, server):
    """An empty text is refused by the server; the page shows the server's own message."""
    _open(browser, server)
    Select(browser.find_element(By.ID, "model")).select_by_value("piper")
    browser.find_element(By.ID, "text").clear()
    browser.find_element(By.ID, "speak").click()
    assert _settled(browser) == "failed"
    expected = httpx.post(server.url + "/v1/audio/speech", timeout=30,
                          json={"model": "piper", "input": "", "stream_format": "audio", "response_format": "pcm"})
    assert expected.status_code == 400
    shown = browser.find_element(By.ID, "error")
    assert shown.is_displayed() and shown.text == expected.json()["error"]["message"]


def test_engine_options_are_fields_and_reach_the_server(browser, server):
    """The tone model's declared option is a field of the page (nothing in the page names it), bounded as declared;
    a value out of range that gets past the field is the server's 400, shown as is; a good one speaks."""
    _open(browser, server)
    Select(browser.find_element(By.ID, "model")).select_by_value("tone")
    field = WebDriverWait(browser, WAIT).until(
        lambda d: d.find_element(By.CSS_SELECTOR, "#options [data-option='transpose']"))
    assert field.get_attribute("value") == "0" and field.get_attribute("max") == "12"
    browser.execute_script("arguments[0].removeAttribute('max'); arguments[0].value = '99'", field)
    box = browser.find_element(By.ID, "text")
    box.clear()
    box.send_keys("la la")
    browser.find_element(By.ID, "speak").click()
    assert _settled(browser) == "failed"
    assert "transpose" in browser.find_element(By.ID, "error").text
    browser.execute_script("arguments[0].value = '7'", field)
    stats = _speak(browser, "la la")
    assert stats["rate"] == 16000 and stats["seconds"] > 0


def test_the_package_ships_the_page():
    """Every file of the page is covered by the package data that pyproject.toml declares."""
    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["mizuoto.server"]
    files = sorted(p.relative_to(WEB_DIR.parent).as_posix() for p in WEB_DIR.rglob("*") if p.is_file())
    assert {"web/index.html", "web/app.js", "web/style.css"} <= set(files)
    assert all(any(Path(f).match(g) for g in globs) for f in files), (files, globs)


def test_save_a_clip_as_a_voice_and_speak_with_it(browser, server, h, tmp_path):
    """CosyVoice 2 through the page: upload the fixture clip and its transcript, save it, speak with it."""
    import base64

    clip = tmp_path / "clip.wav"
    clip.write_bytes(base64.b64decode(h.clip_base64()))
    _open(browser, server)
    Select(browser.find_element(By.ID, "model")).select_by_value("cosy")
    WebDriverWait(browser, WAIT).until(lambda d: "cosyvoice" in d.find_element(By.ID, "model-info").text)
    browser.find_element(By.CSS_SELECTOR, "#clone summary").click()
    browser.find_element(By.ID, "ref-file").send_keys(str(clip))
    browser.find_element(By.ID, "ref-text").send_keys(h.ref_text)
    browser.find_element(By.ID, "voice-id").send_keys("web-test-voice")
    try:
        browser.find_element(By.ID, "save-voice").click()
        WebDriverWait(browser, WAIT).until(
            lambda d: d.find_element(By.ID, "status").text.startswith("uploaded voice web-test-voice")
            or d.find_element(By.ID, "error").is_displayed())
        assert not browser.find_element(By.ID, "error").is_displayed(), browser.find_element(By.ID, "error").text
        chosen = Select(browser.find_element(By.ID, "voice")).first_selected_option
        assert chosen.get_attribute("value") == "web-test-voice"
        assert chosen.text == "web-test-voice (uploaded: until the server restarts)"  # kept in memory: not "saved"
        browser.find_element(By.ID, "seed").send_keys("5")
        stats = _speak(browser, "A saved voice speaks in the browser.")
        assert stats["rate"] == 24000 and stats["seconds"] > 0 and stats["rms"] > 0, stats
    finally:
        httpx.delete(server.url + "/v1/audio/voices/web-test-voice", timeout=10)


def _select_model(browser, model: str, engine: str) -> None:
    Select(browser.find_element(By.ID, "model")).select_by_value(model)
    WebDriverWait(browser, WAIT).until(lambda d: engine in d.find_element(By.ID, "model-info").text)


def test_instruct_field_only_for_models_with_mode_instruct(browser, server):
    """The instruction field shows for a model whose modes (from /v1/models) include instruct, and its text goes out
    as `instructions`; a model without the mode hides it and sends none."""
    _open(browser, server)
    browser.execute_script(  # the page's speech requests, as sent
        "window.sent = []; const f = window.fetch; window.fetch = (u, o) => {"
        " if (String(u).endsWith('/v1/audio/speech')) window.sent.push(JSON.parse(o.body)); return f(u, o); };")
    _select_model(browser, "tone", "tone")
    field = browser.find_element(By.ID, "instruct")
    assert field.is_displayed()
    field.send_keys("sing it high")
    _speak(browser, "la la")
    _select_model(browser, "piper", "piper")
    assert not field.is_displayed()
    _speak(browser, "No instruction here.")
    sent = browser.execute_script("return window.sent")
    assert sent[0]["instructions"] == "sing it high" and "instructions" not in sent[1], sent


def test_voice_labels_say_which_voices_are_saved(browser, server, h):
    """A voice kept in the server's memory is labelled as lasting until a restart; one stored on the server
    (cached on the model, written to the store) is "saved"; a preset has no label."""
    with httpx.Client(base_url=server.url, timeout=60, headers=h.admin) as c:
        up = c.post("/v1/audio/voices", json={"id": "web-uploaded", "audio": h.wav_base64()})
        kept = c.post("/v1/audio/voices", json={"id": "web-kept", "audio": h.wav_base64(), "model": "tone"})
        try:
            assert up.status_code == 201 and kept.status_code == 201, (up.text, kept.text)
            assert kept.json()["stored"] is True
            _open(browser, server)
            _select_model(browser, "tone", "tone")
            labels = {o.get_attribute("value"): o.text for o in Select(browser.find_element(By.ID, "voice")).options}
            assert labels["web-uploaded"] == "web-uploaded (uploaded: until the server restarts)"
            assert labels["web-kept"] == "web-kept (saved)"
            assert labels["low"] == "low" and labels["high"] == "high"
        finally:
            c.delete("/v1/audio/voices/web-uploaded")
            c.delete("/v1/audio/voices/web-kept")


def _inked_pixels(browser) -> int:
    """Pixels of the waveform canvas that are drawn on (not transparent)."""
    return browser.execute_script(
        "const c = document.getElementById('waveform');"
        " const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        " let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n;")


def test_waveform_is_drawn_and_figures_reset_on_model_change(browser, server):
    """After a synthesis the canvas holds the audio's waveform (across its width); choosing another model clears
    the figures, the waveform and the download of the last synthesis."""
    _open(browser, server)
    _select_model(browser, "tone", "tone")
    assert _inked_pixels(browser) == 0
    stats = _speak(browser, "la la la la")
    width = browser.find_element(By.ID, "waveform").get_attribute("width")
    assert stats["seconds"] > 0 and _inked_pixels(browser) > int(width), "the waveform was not drawn"
    assert browser.find_element(By.ID, "chunks").text != "-"
    _select_model(browser, "piper", "piper")
    for figure in ("first-chunk", "rtf", "audio-seconds", "chunks"):
        assert browser.find_element(By.ID, figure).text == "-", figure
    assert _inked_pixels(browser) == 0 and not browser.find_element(By.ID, "download").is_displayed()
    assert browser.execute_script("return window.mizuotoStats") is None


@pytest.fixture(scope="module")
def keyed_server(served_dirs, h):
    """A server started with --api-key (Piper only): every /v1/* request needs `Authorization: Bearer API_KEY`."""
    s = h.start_server({"piper": served_dirs["piper"]}, ServerConfig(api_key=API_KEY, request_timeout=60.0))
    yield s
    s.stop()


def _shown_error(browser) -> str:
    """Wait until the page shows an error; return it."""
    WebDriverWait(browser, WAIT).until(lambda d: d.find_element(By.ID, "error").is_displayed())
    return browser.find_element(By.ID, "error").text


def _type_key(browser, key: str) -> None:
    """Type `key` into the API key field and press Enter (the page lists the models again), wait until ready."""
    field = browser.find_element(By.ID, "api-key")
    assert field.get_attribute("type") == "password"
    field.clear()
    field.send_keys(key + Keys.ENTER)
    WebDriverWait(browser, WAIT).until(lambda d: d.find_element(By.ID, "status").text in ("ready", "no models"))
    assert browser.find_element(By.ID, "status").text == "ready", browser.find_element(By.ID, "error").text


def test_api_key_field_lists_models_and_speaks(browser, keyed_server):
    """Under --api-key, the key typed into the page goes with every request: the models list, and Piper speaks."""
    browser.get(keyed_server.url + "/")
    assert "needs an API key" in _shown_error(browser)
    _type_key(browser, API_KEY)
    assert not browser.find_element(By.ID, "error").is_displayed()
    assert [o.get_attribute("value") for o in Select(browser.find_element(By.ID, "model")).options] == ["piper"]
    WebDriverWait(browser, WAIT).until(lambda d: "piper" in d.find_element(By.ID, "model-info").text)
    stats = _speak(browser, "The key opens the door. And the browser speaks.")
    assert stats["rate"] == 22050 and stats["seconds"] > 1.0 and stats["rms"] > 0.01, stats
    assert stats["playedPeak"] > 0.05, f"the audio did not play out loud: {stats}"
    # Kept in the page only: nothing stored in the browser, and only this server was asked for anything.
    stored = browser.execute_script("return [localStorage.length, sessionStorage.length, document.cookie]")
    assert stored == [0, 0, ""], stored
    resources = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert all(r.startswith(keyed_server.url + "/") for r in resources), resources


def test_without_the_api_key_the_page_asks_for_it(browser, keyed_server):
    """Under --api-key, a missing or wrong key shows a message asking for the key: on listing and on Speak."""
    browser.get(keyed_server.url + "/")
    message = _shown_error(browser)
    assert "this server needs an API key (401)" in message and "API key field" in message, message
    assert browser.find_element(By.ID, "status").text == "no models"
    assert browser.find_element(By.ID, "api-key").get_attribute("aria-invalid") == "true"

    field = browser.find_element(By.ID, "api-key")
    field.send_keys("not-the-key" + Keys.ENTER)
    WebDriverWait(browser, WAIT).until(lambda d: "refused this API key" in d.find_element(By.ID, "error").text)
    assert browser.find_element(By.ID, "status").text == "no models"

    # Listed with the key, then the key is cleared: Speak answers 401, and the page asks for the key again.
    _type_key(browser, API_KEY)
    browser.execute_script("document.getElementById('api-key').value = ''")  # no change event: no new listing
    browser.find_element(By.ID, "speak").click()
    assert _settled(browser) == "failed"
    assert "this server needs an API key (401)" in browser.find_element(By.ID, "error").text
