"""The one exception family every Mizuoto failure a user can cause is raised as."""


class MizuotoError(Exception):
    """Base class: a clear, one-line, user-facing error; `field` names the request field it is about, as data.

    Fields are a SynthesisRequest's: "text", "voice", "reference" (a Reference's audio or text),
    "mode", "instruct", "speed", "stream", "seed", "options", "source_audio". A front end maps them
    to its own names (the server: `server.errors.PARAMS`), never from the message's words.
    """

    def __init__(self, *args: object, field: str | None = None) -> None:
        super().__init__(*args)
        self.field = field


class InvalidRequest(MizuotoError, ValueError):
    """A request, option or argument is malformed; nothing has run yet."""


class ModelLoadError(MizuotoError):
    """A model directory is missing, unreadable, of an unknown kind, or corrupt."""


class AudioError(MizuotoError, ValueError):
    """An audio file or buffer is unreadable, empty, or of an unsupported rate."""


class ResourceError(MizuotoError):
    """A shared resource (e.g. FSTs) or cache file is missing or invalid."""


class MemoryBudgetError(MizuotoError):
    """A model or stage cannot fit the memory budget."""


class RequestCancelled(MizuotoError):
    """A running request was cancelled by its caller (it stops at the next stage call)."""


class RequestTooLarge(MemoryBudgetError):
    """One request needs more memory than the model's budget allows; refused before it starts."""


class ModelUnloaded(InvalidRequest):
    """The model named was unloaded (by its owner, or evicted by the planner to make room for another)."""


class ModelBusy(InvalidRequest):
    """The model is running a request, so it cannot be unloaded now."""


class DeadlineExceeded(RequestCancelled):
    """A request ran past its deadline; it stops as a cancelled one does."""


def quoted(value: object, limit: int = 40) -> str:
    """`value` for an error message: its repr, or a short prefix of it (a client's value may be megabytes)."""
    if isinstance(value, (str, bytes)):
        if len(value) <= limit:
            return repr(value)
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{value[:limit]!r}... ({len(value)} {unit})"
    if value is None or isinstance(value, (bool, int, float)):
        try:
            text = repr(value)
        except ValueError:  # an int past Python's digit limit for str()
            return "a very long integer"
        return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} digits)"
    size = f" of {len(value)}" if hasattr(value, "__len__") else ""  # a list or a dict: its kind, not its items
    return f"a {type(value).__name__}{size}"
