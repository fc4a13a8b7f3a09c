"""HTTP server over Runtime: OpenAI-style speech, streaming, voices and model management.

Needs the optional `server` extra (FastAPI on Starlette, pydantic, uvicorn, prometheus_client,
python-multipart); importing this package alone imports none of them, so the core stays usable
without it. Entry points: `create_app` in app.py and the
`mizuoto serve` command in cli.py.
"""
