"""GET /openapi.json: exactly the app's routes, valid OpenAPI 3.1, with the limits validation checks."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route, WebSocketRoute

from mizuoto.runtime.engine import SPEED_RANGE
from mizuoto.server import openapi
from mizuoto.server.app import create_app
from mizuoto.server.launch import ServerThread
from mizuoto.server.state import ServerConfig
from mizuoto.server.validation import SPEECH_FIELDS

KEYS = ServerConfig(api_key="user-key", admin_key="admin-key", max_input_chars=123)


@pytest.fixture(scope="module")
def app(h):
    """An app with both keys and no models (the document does not depend on them)."""
    return create_app(h.make_runtime(), KEYS, {})


def _route_table(app) -> tuple[set[tuple[str, str]], set[str]]:
    """({(method, OpenAPI path)} of the HTTP routes, {WebSocket paths}) read from Starlette's route table."""
    http, sockets = set(), set()
    for route in app.routes:
        if isinstance(route, WebSocketRoute):
            sockets.add(route.path)
        elif isinstance(route, Mount):
            http.add(("GET", route.path + "/{path}"))
        else:
            assert isinstance(route, Route), route
            http |= {(m, route.path) for m in route.methods if m != "HEAD"}  # Starlette adds HEAD to every GET
    return http, sockets


def test_every_route_is_described_and_nothing_else(app):
    """Each HTTP route and method of the route table is an operation of the document, and each operation a route."""
    http, sockets = _route_table(app)
    doc = app.state.openapi
    described = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert described == http
    assert set(doc[openapi.WEBSOCKETS]) == sockets == {"/v1/audio/speech/stream"}
    assert ("GET", "/openapi.json") in described and ("POST", "/v1/audio/speech") in described


def test_a_route_and_its_description_cannot_drift(app):
    """A route without a description, or a description without its route, fails the build of the document."""
    async def extra(request):
        return JSONResponse({})

    routes = list(app.routes)
    for changed in (routes + [Route("/v1/extra", extra, methods=["GET"])],
                    [r for r in routes if getattr(r, "path", "") != "/metrics"]):
        with pytest.raises(LookupError, match="/v1/extra|/metrics"):
            openapi.document(changed, ("wav",), 10, api_key=False)


def test_document_is_valid_openapi(app):
    """The document validates against the OpenAPI 3.1 schema (schemathesis' copy of it)."""
    schema = schemathesis.openapi.from_dict(app.state.openapi)
    schema.validate()
    assert app.state.openapi["openapi"] == "3.1.0"
    with pytest.raises(ValueError):  # the check is real: a broken document is refused (jsonschema_rs' error)
        schemathesis.openapi.from_dict({**app.state.openapi, "paths": {"/x": {"get": {"responses": 5}}}}).validate()


def test_security_follows_the_keys(app, h):
    """With --api-key every /v1 route takes either key, admin routes only the admin key, health and docs none."""
    paths = app.state.openapi["paths"]
    assert paths["/v1/audio/speech"]["post"]["security"] == [{"apiKey": []}, {"adminKey": []}]
    assert paths["/v1/models/load"]["post"]["security"] == [{"adminKey": []}]
    assert paths["/v1/audio/voices/{voice_id}"]["delete"]["security"] == [{"adminKey": []}]
    for path in ("/health", "/ready", "/metrics", "/openapi.json", "/"):
        assert "security" not in paths[path]["get"]
    assert {"401", "403"} <= set(paths["/v1/models/load"]["post"]["responses"])
    assert "401" in paths["/v1/models"]["get"]["responses"]
    open_doc = create_app(h.make_runtime(), ServerConfig(admin_key="a"), {}).state.openapi
    assert "security" not in open_doc["paths"]["/v1/audio/speech"]["post"]
    assert "401" not in open_doc["paths"]["/v1/audio/speech"]["post"]["responses"]
    assert set(open_doc["components"]["securitySchemes"]) == {"adminKey"}


def test_speech_body_is_what_validation_checks(app):
    """The speech body lists validation's fields, this server's formats and length limit, and the speed range."""
    op = app.state.openapi["paths"]["/v1/audio/speech"]["post"]
    body = op["requestBody"]["content"]["application/json"]["schema"]
    props = body["properties"]
    assert list(props) == list(SPEECH_FIELDS) and body["additionalProperties"] is False
    assert body["required"] == ["model", "input"]
    assert props["response_format"]["enum"] == list(app.state.mizuoto.formats)
    assert props["input"]["maxLength"] == props["instructions"]["maxLength"] == KEYS.max_input_chars
    assert (props["speed"]["minimum"], props["speed"]["maximum"]) == SPEED_RANGE
    assert {"400", "404", "413", "503"} <= set(op["responses"])
    assert "Retry-After" in op["responses"]["503"]["headers"]


def test_served_without_a_key(h):
    """GET /openapi.json answers the document, with no key even on a server that has one."""
    app = create_app(h.make_runtime(), KEYS, {})
    with ServerThread(app) as server:
        r = httpx.get(f"{server.url}/openapi.json")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.json() == app.state.openapi
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
