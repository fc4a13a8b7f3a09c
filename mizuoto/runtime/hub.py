"""Model ids: `-m org/name[@revision]` names a Hugging Face repository, found in the hub's cache or downloaded.

A directory that exists always wins over a repo id of the same spelling. `huggingface_hub` (the
`hub` extra) is imported only when an id is given; the cache is the hub's own (`$HF_HUB_CACHE`,
`$HF_HOME`), and `HF_HUB_OFFLINE=1` keeps it to the cache.
"""

from __future__ import annotations

import re
from pathlib import Path

from mizuoto.errors import ModelLoadError

REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})"
                     r"(?:@(?P<revision>[A-Za-z0-9][A-Za-z0-9_./-]{0,127}))?$")
INSTALL = "pip install 'mizuoto-runtime[hub]'"
DOWNLOAD = "hf download"  # huggingface_hub's console script (`huggingface-cli` is gone from current releases)


def is_repo_id(spec: str) -> bool:
    """True when `spec` is spelled as `org/name[@revision]` and no such directory exists."""
    return bool(REPO_ID.match(str(spec))) and not Path(spec).exists()


def _named_example(spec: str) -> Path | None:
    """The directory a plugin offers under the short id `spec` (e.g. Piper's `en_US-joe-medium`), or None."""
    if not spec or "/" in spec or "\\" in spec:
        return None
    from mizuoto.runtime.plugins import default_registry

    return default_registry().named_examples().get(spec)


def resolve_model(spec: str | Path) -> Path:
    """The model directory `spec` names: an existing path as is, or a repo id's snapshot in the hub cache.

    The cache is tried first (no network); a repo missing there is downloaded unless the hub is
    offline (`HF_HUB_OFFLINE=1`). A bare name that is no path may be the short id of a model a
    plugin offers (`en_US-joe-medium`, the Piper plugin's voice). Anything else is returned as a
    path, for the loader to refuse.
    """
    if isinstance(spec, Path) or Path(spec).exists():
        return Path(spec)
    if not is_repo_id(spec):
        return _named_example(spec) or Path(spec)
    m = REPO_ID.match(spec)
    repo, revision = m["repo"], m["revision"]
    try:
        import huggingface_hub
        from huggingface_hub import constants
        from huggingface_hub.utils import HfHubHTTPError
    except ImportError:
        raise ModelLoadError(f"{spec!r} is neither a model directory nor loadable as a Hugging Face repo id: "
                             f"that needs huggingface_hub ({INSTALL})") from None
    try:
        return Path(huggingface_hub.snapshot_download(repo, revision=revision, local_files_only=True))
    except Exception as cached_miss:  # not in the cache (LocalEntryNotFoundError and kin)
        if constants.HF_HUB_OFFLINE:
            raise ModelLoadError(f"model {spec!r} is not in the Hugging Face cache "
                                 f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set: "
                                 f"download it where the network allows ({DOWNLOAD} {repo})") \
                from cached_miss
    try:
        return Path(huggingface_hub.snapshot_download(repo, revision=revision))
    except HfHubHTTPError as e:
        raise ModelLoadError(f"cannot download model {spec!r} from the Hugging Face hub: {e}".splitlines()[0]) \
            from None
    except Exception as e:  # no network, DNS, timeouts: one line saying so
        raise ModelLoadError(f"model {spec!r} is not in the Hugging Face cache and cannot be downloaded "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'})") from None
