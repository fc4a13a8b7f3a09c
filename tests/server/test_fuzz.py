"""A property-based fuzz of every operation the running server's /openapi.json describes.

Schemathesis loads the document from a real server on 127.0.0.1 (a tone model only, so it is
fast). Each operation gets schemathesis' coverage cases (boundary values, wrong types, missing
fields, unexpected methods), then derandomized generated cases, schema-valid and schema-invalid,
all with the admin key. Every answer must be documented (status code, content type, headers,
body schema), none may be a 5xx, a request the document refuses must be refused (4xx), an
operation that declares a key must refuse a request without one, and afterwards the server still
speaks.

A 5xx fails the fuzz even where the document lists it (500, 503, 504, 507 on speech, 503 on voice
uploads): cases go one at a time to a server with free slots and no memory limit, so none of
those answers is legitimate here. The one 5xx accepted is GET /ready's 503, its documented "not
ready" answer, given once the fuzz has unloaded the model (requests load it again). Schemathesis'
positive_data_acceptance check is left out: the document is looser than the server on purpose
(a voice must be one of the model's, text must not be blank), so a schema-valid request may still
be a 400.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import schemathesis
import soundfile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup, ServerError
from schemathesis.openapi.checks import UndefinedStatusCode
from schemathesis.specs.openapi.checks import (content_type_conformance, ignored_auth, missing_required_header,
                                               negative_data_rejection, response_headers_conformance,
                                               response_schema_conformance, status_code_conformance,
                                               unsupported_method)

from mizuoto.runtime.api import Runtime
from mizuoto.server.app import create_app
from mizuoto.server.launch import ServerThread
from mizuoto.server.state import ServerConfig
from mizuoto.testing.toy import ToneModel

API_KEY, ADMIN_KEY = "fuzz-api-key", "fuzz-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MAX_CHARS = 64  # the server's --max-input-chars: keeps the tone engine's audio short
EXAMPLES = 100  # generated cases per operation and generation mode (the coverage cases come on top)
MODEL = "tone"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection, missing_required_header, unsupported_method,
          ignored_auth]


def _clip() -> str:
    """A short reference clip (0.6 s of a voiced tone, FLAC) as base64: small, so a failure's report stays short."""
    rate = 16000
    t = np.arange(int(0.6 * rate)) / rate
    wave = sum(np.sin(2 * np.pi * k * 180.0 * t) / k for k in range(1, 5)) * 0.2
    buf = io.BytesIO()
    soundfile.write(buf, wave.astype(np.float32), rate, format="FLAC", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


CLIP = _clip()


def _config() -> ServerConfig:
    return ServerConfig(api_key=API_KEY, admin_key=ADMIN_KEY, max_input_chars=MAX_CHARS, request_timeout=30.0,
                        idle_timeout=5.0, drain_seconds=0.0)


# every (method, path) the app describes; test_every_operation_is_fuzzed checks the served document has these
OPERATIONS = sorted((m.upper(), p) for p, ops in create_app(Runtime(plugins=False, voices=False), _config(), {})
                    .openapi()["paths"].items() for m in ops)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, h):
    """A server with both keys over a tone model; voices cached by the fuzz stay in its own store."""
    root = tmp_path_factory.mktemp("fuzz")
    server = h.start_server({MODEL: h.write_model(root / "tone")}, _config(), voices=root / "voices")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api(fuzz_server):
    """The server's own OpenAPI document, as schemathesis loads it from the running server."""
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


def steer(case: schemathesis.Case, choice: int, model: str, clip: str) -> schemathesis.Case:
    """Point a schema-valid case at what the server holds (choice 1 or 2; 0 leaves it), keeping it schema-valid.

    Random model names are all 404s and random base64 is never audio: without this, no case would
    get past the first lookup. Multipart bodies are left as generated: schemathesis reclassifies
    any changed body holding a file as schema-invalid.
    """
    body = case.body
    if choice == 0 or not isinstance(body, dict) or (case.media_type or "").startswith("multipart/"):
        return case
    path, new = case.operation.path, dict(body)
    if path == "/v1/audio/speech":
        new["model"] = model
        if choice == 2:  # the plain request: the model's default voice, no reference
            for key in ("voice", "ref_audio", "ref_text", "instructions"):
                new.pop(key, None)
        elif "ref_audio" in new:
            new["ref_audio"] = clip
    elif path == "/v1/audio/voices":
        new["audio"] = clip
        if choice == 2:  # cached on the model (and stored); choice 1: uploaded
            new["model"] = model
        else:
            new.pop("model", None)
    elif path in ("/v1/models/load", "/v1/models/unload"):
        new["model"] = model
        new.pop("path", None)
    else:
        return case
    case.body = new
    return case


def _valid(case: schemathesis.Case) -> bool:
    """True for a case schemathesis generated schema-valid in every part."""
    return case.meta is None or not any(c.mode.is_negative for c in case.meta.components.values())


def _check(case: schemathesis.Case) -> None:
    ready = case.operation.path == "/ready"  # 503 there means "not ready", still checked as documented
    checks = [c for c in CHECKS if not (ready and c is not_a_server_error)]
    case.call_and_validate(headers=ADMIN, timeout=30, checks=checks)


def fuzz(api: schemathesis.BaseSchema, method: str, path: str, examples: int, model: str, clip: str) -> None:
    """Coverage cases, then generated valid and invalid cases of one operation; raises the first failure found."""
    operation = api[path][method]
    generation = api.config.generation_for(operation=operation, phase="coverage")
    coverage = api.iter_coverage_cases(operation, generation_modes=list(GenerationMode), generation_config=generation)
    for i, case in enumerate(coverage):
        _check(steer(case, i % 3, model, clip) if _valid(case) else case)
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        strategy = operation.as_strategy(generation_mode=mode)
        if mode is GenerationMode.POSITIVE:
            strategy = st.tuples(strategy, st.integers(0, 2)).map(lambda drawn: steer(*drawn, model, clip))

        @given(case=strategy)
        @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        def run(case: schemathesis.Case) -> None:
            _check(case)

        try:
            run()
        except Unsatisfiable:
            # an operation without inputs (or with free strings only) has no schema-invalid request
            assert mode is GenerationMode.NEGATIVE, f"{method} {path}: no schema-valid case could be generated"


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_fuzz(api, method, path):
    """One documented operation under generated input: documented answers only, never a 5xx."""
    fuzz(api, method, path, EXAMPLES, MODEL, CLIP)


def test_every_operation_is_fuzzed(api):
    """The served document describes exactly the operations parametrized above."""
    served = sorted((m.upper(), p) for p, ops in api.raw_schema["paths"].items() for m in ops)
    assert served == OPERATIONS


class CrashToneModel(ToneModel):
    """A tone model whose every request fails inside the engine: the 500 planted for the fuzz to find."""

    def synthesize(self, request):
        raise RuntimeError("planted engine bug")


def test_fuzz_catches_a_planted_500(tmp_path, h):
    """The same fuzz over a model that crashes fails with schemathesis' server-error finding."""
    rt = h.make_runtime(voices=tmp_path / "voices")
    rt.registry.add(h.tone_engine("crash", CrashToneModel, "tone engine whose requests crash"))
    server = ServerThread(create_app(rt, _config(), {"crash": h.write_tone_model(tmp_path / "crash", "crash")}))
    with server:
        api = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
        with pytest.raises(FailureGroup) as found:
            fuzz(api, "POST", "/v1/audio/speech", 5, "crash", CLIP)
    assert any(isinstance(f, ServerError) and f.status_code == 500 for f in found.value.exceptions), found.value


def test_fuzz_catches_an_undocumented_status(fuzz_server):
    """With 404 left out of a copy of the document, the fuzz of GET /v1/audio/voices (?model= unknown) fails."""
    document = httpx.get(f"{fuzz_server.url}/openapi.json").json()
    del document["paths"]["/v1/audio/voices"]["get"]["responses"]["404"]
    api = schemathesis.openapi.from_dict(document)
    api.config.update(base_url=fuzz_server.url)
    with pytest.raises(FailureGroup) as found:
        fuzz(api, "GET", "/v1/audio/voices", 5, MODEL, CLIP)
    assert any(isinstance(f, UndefinedStatusCode) and f.status_code == 404 for f in found.value.exceptions)


def test_server_still_serves_after_the_fuzz(fuzz_server, h):
    """After every fuzz case (this module's last test): healthy, no job left running, and a normal request speaks."""
    with httpx.Client(base_url=fuzz_server.url, timeout=30.0, headers=ADMIN) as client:
        assert client.get("/health").json() == {"status": "ok"}
        h.wait_idle(client)
        r = client.post("/v1/audio/speech", json={"model": MODEL, "input": "still here", "voice": "low"})
        assert r.status_code == 200, r.text
        audio, rate = h.read_audio(r.content)
        assert rate == int(r.headers["x-sample-rate"]) == 16000
        assert abs(audio.size / rate - h.tone_seconds("still here")) < 0.01 and np.abs(audio).max() > 0.05
        assert client.get("/ready").status_code == 200
