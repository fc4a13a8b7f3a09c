"""Ray Serve: the same OpenAI-style API served from Ray replicas (`mizuoto[ray]`, `mizuoto ray-serve config.yaml`).

Each replica runs the HTTP app of `mizuoto serve` over its own Runtime, with its own memory
budget. Models are multiplexed per replica (`@serve.multiplexed`): a speech request's model
(the `serve_multiplexed_model_id` header, else the body's `model`) is loaded into the replica
that takes it, at most `models_per_replica` at once, least recently used first out. Ray's
`max_ongoing_requests` is the replica's concurrent jobs (Mizuoto's `--max-concurrent`);
`max_queued_requests` bounds the queue in front of the replicas, past which Ray answers 503
with `Retry-After`. Ray is imported only here.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mizuoto.errors import InvalidRequest, MizuotoError

log = logging.getLogger("mizuoto.ray")
MODEL_HEADER = b"serve_multiplexed_model_id"
INSTALL = "pip install 'mizuoto-runtime[ray]'"


@dataclass(frozen=True)
class RayConfig:
    """A `mizuoto ray-serve` config file: the models, the replicas and their limits, where to listen."""

    models: dict[str, str]  # name -> model directory or Hugging Face repo id
    replicas: int = 1
    models_per_replica: int = 2
    max_ongoing_requests: int = 4  # per replica: Mizuoto's concurrent jobs
    max_queued_requests: int = 16  # queued in front of the replicas; past it 503 + Retry-After
    retry_after: int = 1
    vram: str | None = None  # each replica's Runtime budgets
    ram: str | None = None
    num_cpus: float = 1.0  # Ray resources of one replica
    num_gpus: float = 0.0
    options: dict = field(default_factory=dict)  # load options (device, precision, option.*)
    request_timeout: float | None = 300.0
    api_key: str | None = None
    admin_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    address: str | None = None  # an existing Ray cluster; None starts a local one
    cluster_cpus: int | None = None  # CPUs of the local Ray started when `address` is None

    @classmethod
    def from_dict(cls, data: Any, where: str = "config") -> RayConfig:
        """Checked fields of a parsed config; unknown keys and bad values are one-line errors."""
        if not isinstance(data, dict):
            raise InvalidRequest(f"{where}: expected a mapping of settings, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequest(f"{where}: unknown setting {unknown[0]!r}; known: {', '.join(sorted(known))}")
        models = data.get("models")
        if not isinstance(models, dict) or not models or not all(isinstance(v, str) for v in models.values()):
            raise InvalidRequest(f"{where}: 'models' must map model names to directories or repo ids")
        config = cls(**{**data, "models": {str(k): v for k, v in models.items()}})
        for name in ("replicas", "models_per_replica", "max_ongoing_requests"):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequest(f"{where}: {name} must be a positive integer, got {value!r}")
        if not isinstance(config.max_queued_requests, int) or config.max_queued_requests < -1:
            raise InvalidRequest(f"{where}: max_queued_requests must be -1 (no bound) or more, "
                                 f"got {config.max_queued_requests!r}")
        return config


def read_config(path: str | Path) -> RayConfig:
    """A RayConfig from a YAML (or JSON) file."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise InvalidRequest(f"cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise InvalidRequest(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    return RayConfig.from_dict(data, str(path))


class _Held:
    """A model loaded in one replica for Ray's multiplexing LRU; unloading it frees the replica's Runtime."""

    def __init__(self, runtime: Any, name: str):
        self.runtime, self.name, self._done = runtime, name, False

    def __del__(self) -> None:  # Ray calls it when the LRU drops the model (Python may call it again)
        if self._done:
            return
        self._done = True
        try:
            if self.name in [m.name for m in self.runtime.models()]:
                self.runtime.unload(self.name)
        except MizuotoError as e:  # busy, or evicted meanwhile by the Runtime's own planner
            log.info("model %s not unloaded on LRU eviction: %s", self.name, e)


class _Multiplexed:
    """ASGI wrapper: before a speech request reaches the app, its model is taken through `load` (Ray's LRU)."""

    def __init__(self, app: Any, load: Any, limit: int):
        self.app, self.load, self.limit = app, load, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") != "/v1/audio/speech":
            await self.app(scope, receive, send)
            return
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body") or size > self.limit:
                break
        model = dict(scope.get("headers") or []).get(MODEL_HEADER, b"").decode("latin-1") or None
        if model is None and size <= self.limit:
            try:
                model = json.loads(b"".join(m.get("body", b"") for m in messages)).get("model")
            except (ValueError, AttributeError):
                model = None
        if isinstance(model, str) and model:
            try:
                await self.load(model)
            except Exception as e:  # unknown model and the like: the app answers it as it would anyway
                log.debug("multiplexed load of %r: %s", model, e)

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def build_app(config: RayConfig) -> Any:
    """The Ray Serve application (a bound deployment) for `config`."""
    try:
        from ray import serve
    except ImportError:
        raise MizuotoError(f"Ray Serve is not installed: {INSTALL}") from None
    settings = asdict(config)

    @serve.deployment(name="mizuoto", num_replicas=config.replicas,
                      max_ongoing_requests=config.max_ongoing_requests,
                      max_queued_requests=config.max_queued_requests,
                      backpressure_config={"status_code": 503, "retry_after_s": config.retry_after},
                      ray_actor_options={"num_cpus": config.num_cpus, "num_gpus": config.num_gpus})
    @serve.ingress()
    class Mizuoto:
        """One replica: a Runtime with its own budget, the HTTP app over it, models multiplexed."""

        async def __init__(self, settings: dict):
            from mizuoto.runtime.api import Runtime
            from mizuoto.runtime.hub import resolve_model

            self.config = RayConfig.from_dict(settings)
            self.runtime = Runtime(vram=self.config.vram, ram=self.config.ram)
            self.catalogue = {name: resolve_model(spec) for name, spec in self.config.models.items()}

        def __serve_build_asgi_app__(self) -> Any:
            from mizuoto.server.app import create_app
            from mizuoto.server.state import ServerConfig

            c = self.config
            server = ServerConfig(max_concurrent=c.max_ongoing_requests, request_timeout=c.request_timeout,
                                  retry_after=c.retry_after, load_options=dict(c.options), api_key=c.api_key,
                                  admin_key=c.admin_key)
            app = create_app(self.runtime, server, self.catalogue, preload=False)
            self.state = app.state.mizuoto
            return _Multiplexed(app, self.model, server.max_body_bytes)

        @serve.multiplexed(max_num_models_per_replica=config.models_per_replica)
        async def model(self, model_id: str) -> _Held:
            """Load `model_id` into this replica (Ray keeps the most recently used ones)."""
            from mizuoto.server.session import Session

            session = Session(self.state, None, stream=False)  # a load alone: its lease, no text
            try:
                await session.load(model_id)  # under a slot and the lease, as a request's own load
            finally:
                session.close()
            return _Held(self.runtime, model_id)

    return Mizuoto.bind(settings)


def app_builder(args: dict) -> Any:
    """`serve run mizuoto.server.ray_serve:app_builder config=CONFIG.yaml`: the application of a config file."""
    if "config" not in args:
        raise InvalidRequest("serve run mizuoto.server.ray_serve:app_builder needs config=PATH.yaml")
    return build_app(read_config(args["config"]))
