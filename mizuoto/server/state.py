"""What one server holds: the Runtime, its catalogue of model directories, uploaded voices, limits, metrics."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mizuoto.runtime.engine import Reference
from mizuoto.runtime.lease import POLL_S, Lease
from mizuoto.runtime.threads import join_spawned
from mizuoto.errors import InvalidRequest
from mizuoto.server.audio import available_formats
from mizuoto.server.errors import ApiError
from mizuoto.server.admission import JobSlots
from mizuoto.server.aliases import Aliases
from mizuoto.server.jobs import Job
from mizuoto.server.metrics import Metrics
from mizuoto.server.bodies import speech_body_bytes
from mizuoto.server.schemas import NAME, engine_options, speech_model


log = logging.getLogger("mizuoto.server")
LOAD_WAIT_S = 300.0  # without a request timeout: how long a catalogue load waits for memory held by running requests


@dataclass(frozen=True)
class ServerConfig:
    """Limits and defaults of a server (each is a `mizuoto serve` flag)."""

    max_concurrent: int = 4  # jobs running at once, over all models (--max-concurrent)
    max_queued: int = 32  # jobs waiting for a slot, first come first served; past that 503 (--max-queued)
    queue_timeout: float | None = 120.0  # seconds a job may wait in the queue before its 503 (--queue-timeout)
    request_timeout: float | None = 300.0  # seconds from arrival to the last chunk
    max_input_chars: int = 4096
    max_body_bytes: int = 32 << 20
    retry_after: int = 1  # seconds, in the Retry-After header of a 503
    max_voices: int = 64
    load_options: dict = field(default_factory=dict)
    model_roots: tuple[Path, ...] = ()  # directories whose model subfolders POST /v1/models/load may load
    # glibc (see malloc.py): buffers this big get their own mappings, unmapped when freed; None leaves it as is
    mmap_threshold: int | None = 1 << 20
    malloc_arenas: int | None = 2  # glibc: at most this many heap arenas for all threads; None leaves it as is
    api_key: str | None = None  # required as `Authorization: Bearer <key>` on /v1/* when set
    admin_key: str | None = None  # required for loading/unloading models and deleting voices; unset: those are off
    header_timeout: float = 10.0  # seconds a connection may take to send its request line and headers
    idle_timeout: float = 30.0  # seconds a request body or a WebSocket session may stay silent
    body_timeout: float = 60.0  # seconds a whole request body may take, however it trickles
    drain_seconds: float = 2.0  # on SIGTERM/SIGINT: /ready answers 503 this long before the listener closes
    max_upload_parts: int = 16  # multipart parts read from one voice upload
    # a speech request's response_format when it gives none (streamed: wav); `mizuoto serve` sets mp3, OpenAI's
    default_format: str = "wav"
    model_aliases: tuple[str, ...] = ()  # "ALIAS=MODEL" each (--alias): aliases.py
    voice_aliases: tuple[str, ...] = ()  # "ALIAS=[MODEL/]VOICE" each (--voice-alias)


@dataclass(frozen=True)
class StoredVoice:
    """A voice registered with POST /v1/audio/voices: its reference audio and transcript.

    The samples are mono float32 at `rate`; an upload keeps at most 30 s at 48 kHz (audio.MAX_VOICE_*).
    """

    id: str
    samples: torch.Tensor
    rate: int
    text: str | None

    def reference(self) -> Reference:
        """The voice as a Reference for a request."""
        return Reference((self.samples, self.rate), self.text)


class ServerState:
    """Shared by every route; the Runtime does the work."""

    def __init__(self, runtime: Any, config: ServerConfig, models: dict[str, Path] | None = None):
        self.runtime = runtime
        self.config = config
        for name in models or {}:
            if not NAME.fullmatch(name):
                raise InvalidRequest(f"model name {name!r} must be 1-128 letters, digits or '_', '.', ':', '/', '-' "
                                     "(give it as NAME=DIR)")
        self.catalogue: dict[str, Path] = {k: Path(v) for k, v in (models or {}).items()}
        # uploaded voices, copied on write (under voice_lock): a listing on the event loop iterates the dict it
        # read while a thread adds or deletes a voice, so neither waits and no iteration can fail
        self.voices: dict[str, StoredVoice] = {}
        # an id is checked against every voice and reserved in one step, so two creations never share it
        self.voice_lock = threading.Lock()
        self.creating: set[str] = set()  # ids of voices being decoded or cached now (reserved by voices.register)
        self.limiter = JobSlots(config.max_concurrent, config.max_queued, config.queue_timeout)
        self.metrics = Metrics()
        self.jobs: set[Job] = set()
        self.closing = False
        self._load_lock = threading.Lock()  # admin loads and unloads; picking a catalogue model's loader
        self._loading: dict[str, threading.Event] = {}  # catalogue models being loaded -> set when done
        self.formats = available_formats()
        if config.default_format not in self.formats:
            raise InvalidRequest(f"default format {config.default_format!r} has no encoder here; available: "
                                 f"{', '.join(self.formats)}")
        self.aliases = Aliases.parse(config.model_aliases, config.voice_aliases, self.catalogue)
        # each engine's declared request options, for the document
        options = engine_options(runtime.engines() if hasattr(runtime, "engines") else {})
        self.speech = speech_model(self.formats, config.max_input_chars, default_format=config.default_format,
                                   options=options)  # the speech body's model
        # what a speech request can hold (texts, options, a reference clip), and so a WebSocket message
        self.speech_body_bytes = min(config.max_body_bytes, speech_body_bytes(config.max_input_chars))
        # a WebSocket or Wyoming session's fields: raw PCM out, the text sent apart
        self.session = speech_model(("pcm",), config.max_input_chars, need_input=False, default_format="pcm",
                                    options=options)

    # ---- voices and paths ----------------------------------------------------------------------
    def add_uploaded(self, voice: StoredVoice) -> None:
        """Keep an uploaded voice (a new dict: listings iterate the old one undisturbed)."""
        with self.voice_lock:
            self.voices = {**self.voices, voice.id: voice}

    def drop_uploaded(self, voice_id: str) -> bool:
        """Forget an uploaded voice; False when there was none of that id."""
        with self.voice_lock:
            if voice_id not in self.voices:
                return False
            self.voices = {k: v for k, v in self.voices.items() if k != voice_id}
            return True

    def private_paths(self) -> list[str]:
        """This server's directories, which no error message may show: the models', the model roots and the
        voice store, as given and resolved, longest first (so a path inside another is hidden whole)."""
        store = getattr(self.runtime, "voice_store", None)
        dirs = [*self.catalogue.values(), *self.config.model_roots, *([store.root] if store is not None else [])]
        found = {str(p) for d in dirs for p in (Path(d), Path(d).resolve())}
        return sorted((p for p in found if len(p) > 1), key=len, reverse=True)  # never '/' itself

    # ---- models --------------------------------------------------------------------------------
    def loaded(self) -> list[str]:
        """Names of the models loaded now."""
        return [m.name for m in self.runtime.models()]

    def check_model(self, name: str) -> None:
        """404 unless `name` is loaded or can be loaded from the catalogue (the names are not listed: GET /v1/models)."""
        if name not in self.catalogue and name not in self.loaded():
            raise ApiError(404, f"model {name!r} does not exist; GET /v1/models lists the served models", "model")

    def model_label(self, name: str) -> str:
        """`name` for metrics when it is a served model, else "" (a client cannot grow the label set)."""
        return name if name in self.catalogue else ""

    def is_admin(self, header: str | None) -> bool:
        """Whether the request carries the admin key."""
        try:
            self.authorize(header, admin=True)
            return True
        except ApiError:
            return False

    def authorize(self, header: str | None, admin: bool) -> None:
        """401/403 unless the request carries the key its route needs (`Authorization: Bearer <key>`)."""
        token = header[7:].strip() if header and header[:7].lower() == "bearer " else None
        if admin:
            if self.config.admin_key is None:
                raise ApiError(403, "model and voice administration is off; start the server with --admin-key "
                                    "(or MIZUOTO_ADMIN_KEY) to allow it", headers={})
            if token is None or not secrets.compare_digest(token.encode(), self.config.admin_key.encode()):
                raise ApiError(401 if token is None else 403, "this route needs the admin key "
                               "(Authorization: Bearer <admin key>)", headers={"WWW-Authenticate": "Bearer"})
            return
        if self.config.api_key is None:
            return
        keys = [k for k in (self.config.api_key, self.config.admin_key) if k]
        if token is None or not any(secrets.compare_digest(token.encode(), k.encode()) for k in keys):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                           headers={"WWW-Authenticate": "Bearer"})

    def ensure_loaded(self, name: str, lease: Lease | None = None) -> None:
        """Load a catalogue model that is not loaded (first use, or evicted to make room for another).

        With a `lease`, the model is pinned for it (loaded or not before), atomically with the check:
        no other request can evict it until the lease is released. One thread loads a given name at a
        time; the others wait for that load (bounded by their lease), holding no lock.
        """
        waiter = lease if lease is not None else Lease(self.config.request_timeout or LOAD_WAIT_S)
        while True:
            if self._have(name, lease):
                return
            with self._load_lock:  # only to pick the one loader of this name (an admin load may have it)
                flight = self._loading.get(name)
                mine = flight is None and name in self.catalogue
                if mine:
                    flight = self._loading[name] = threading.Event()
            if flight is None:
                self.check_model(name)  # 404, unless it was loaded meanwhile (and still being admitted)
                waiter.check(f"while model {name} loads")
                time.sleep(POLL_S)
                continue
            if not mine:
                waiter.wait(flight, f"while model {name} loads for another request")
                continue
            try:
                if not self._have(name, lease):  # a load that ended just before this one began
                    # when other models' running requests hold the memory, wait for them (as long as
                    # a request may run)
                    self.runtime.load(self.catalogue[name], name=name, lease=lease,
                                      wait=self.config.request_timeout or LOAD_WAIT_S, **self.config.load_options)
                return
            finally:
                with self._load_lock:
                    del self._loading[name]
                flight.set()

    def overloaded(self) -> ApiError:
        """The 503 of a request that finds every slot and every place in the queue taken."""
        return ApiError(503, f"the server is at its limit of {self.config.max_concurrent} concurrent requests"
                             f" and {self.config.max_queued} queued; retry shortly",
                        headers={"Retry-After": str(self.config.retry_after)})

    def load_for_session(self, name: str, lease: Lease) -> None:
        """Load a model for a session (WebSocket, Wyoming, Ray) before its first text, as a request's own load is:
        under a job slot (queued as a job; 503 when none is free) and the session's `lease`, whose cancel and
        deadline end its waits. A model loaded already takes neither: the session's job pins it (or loads it again).

        The slot and the model's pin are the load's alone: they go when it ends (once its work has), while the
        session's lease lives on for its job; an idle session holds neither."""
        if name in self.loaded():
            return
        # the load's own scope: the session's cancel and deadline (without one, as long as a catalogue load may
        # wait), released at the load's end
        held = Lease(cancel=lease.event)
        held.deadline = lease.deadline if lease.deadline is not None else time.monotonic() + LOAD_WAIT_S
        try:
            ticket = self.limiter.enter()
            if ticket is None:
                raise self.overloaded()
            if not self.limiter.wait(ticket, held):
                lease.check("while waiting for a slot to load its model")
                held.check("while waiting for a slot to load its model")
                raise ApiError(503, f"the session waited {self.limiter.timeout:g} s in the queue without a free"
                                    " slot (--queue-timeout); retry shortly",
                               headers={"Retry-After": str(self.config.retry_after)})
            held.on_release(self.limiter.release)  # the slot goes with the load's scope, once its work has ended
            self.ensure_loaded(name, held)
        finally:
            held.release()  # its pin goes: the session's job pins the model again

    def _have(self, name: str, lease: Lease | None) -> bool:
        """Whether `name` is loaded (and now pinned for `lease`, when one is given)."""
        return self.runtime.pin(name, lease) if lease is not None else name in self.loaded()

    def loadable(self, path: Path) -> bool:
        """True for a catalogue directory or one inside a --model-root."""
        path = path.resolve()
        if path in {p.resolve() for p in self.catalogue.values()}:
            return True
        return any(root.resolve() in path.parents for root in self.config.model_roots)

    def load(self, name: str, path: Path, engine: str | None = None) -> tuple[str, list[str]]:
        """Load a model (replacing the catalogue entry of its name); returns (name, models evicted for it).

        The lock is held only to check and to claim the name: requests for other models (and their
        loads) go on while this one loads, and a request for this name waits for it with its lease.
        """
        with self._load_lock:
            before = set(self.loaded())
            if name in before or name in self._loading:
                raise ApiError(409, f"model {name!r} is already loaded or loading; unload it first", "model")
            twin = next((n for n in before if self.catalogue.get(n) is not None
                         and self.catalogue[n].resolve() == path.resolve()), None)
            if twin is not None:
                raise ApiError(409, f"that directory is already loaded as {twin!r}", "path")
            flight = self._loading[name] = threading.Event()
        try:
            loaded = self.runtime.load(path, engine=engine, name=name, **self.config.load_options)
            with self._load_lock:
                self.catalogue[loaded] = path
            return loaded, sorted(before - set(self.loaded()))
        finally:
            with self._load_lock:
                del self._loading[name]
            flight.set()

    def unload(self, name: str) -> None:
        """Unload a loaded model (it stays in the catalogue and loads again on use)."""
        if name not in self.loaded():
            self.check_model(name)
            raise ApiError(409, f"model {name!r} is not loaded", "model")
        with self._load_lock:
            self.runtime.unload(name)

    def shutdown(self, timeout: float) -> None:
        """Refuse new jobs, cancel the running ones and join their workers (within `timeout` s in all),
        then close the runtime (which cancels what still holds a model and joins the models' threads)."""
        self.closing = True
        jobs = list(self.jobs)
        for job in jobs:
            job.cancel("because the server is shutting down")
        end = time.monotonic() + timeout
        left = [job for job in jobs if not job.join(max(0.0, end - time.monotonic()))]
        if left:
            log.warning("%d job(s) still running %.0f s after shutdown began; closing the models under them",
                        len(left), timeout)
        # loads, uploads and decodes the server started in threads of their own (whose waiters may have left)
        stray = join_spawned(max(0.0, end - time.monotonic()))
        if stray:
            log.warning("%d worker thread(s) still running %.0f s after shutdown began", len(stray), timeout)
        self.runtime.close()

    # ---- memory --------------------------------------------------------------------------------
    def memory_rows(self) -> list[tuple[str, str, str, int]]:
        """(metric, device, model, bytes) rows for /metrics."""
        rows, budgets = [], {}
        for info in self.runtime.models():
            try:
                plan = self.runtime.plan(info.name)
            except Exception:  # unloaded or evicted meanwhile
                continue
            budgets[info.device] = plan.budget
            held = plan.peak if info.state == "device" else plan.fixed
            rows.append(("memory_planned_bytes", info.device, info.name, held))
        rows += [("memory_budget_bytes", d, "", b) for d, b in budgets.items()]
        try:
            import psutil

            rows.append(("memory_used_bytes", "host", "", psutil.Process().memory_info().rss))
        except Exception:
            pass
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i in range(torch.cuda.device_count()):
                rows.append(("memory_used_bytes", f"cuda:{i}", "", torch.cuda.memory_allocated(i)))
        return rows
