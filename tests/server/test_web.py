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
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.ui import WebDriverWait

from mizuoto.server.page import WEB_DIR

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
WAIT = 60.0  # seconds for anything the page shows


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
        WebDriverWait(browser, WAIT).until(lambda d: d.find_element(By.ID, "status").text == "saved voice web-test-voice"
                                           or d.find_element(By.ID, "error").is_displayed())
        assert not browser.find_element(By.ID, "error").is_displayed(), browser.find_element(By.ID, "error").text
        assert Select(browser.find_element(By.ID, "voice")).first_selected_option.get_attribute("value") \
            == "web-test-voice"
        browser.find_element(By.ID, "seed").send_keys("5")
        stats = _speak(browser, "A saved voice speaks in the browser.")
        assert stats["rate"] == 24000 and stats["seconds"] > 0 and stats["rms"] > 0, stats
    finally:
        httpx.delete(server.url + "/v1/audio/voices/web-test-voice", timeout=10)
