"""Text to IPA phonemes with the libespeak-ng bundled in the `espeakng-loader` wheel (no system espeak-ng).

espeak-ng keeps global state and is not thread-safe, so every call goes through one lock.
Its public `espeak_TextToPhonemes` drops the punctuation that ended each clause, which Piper
voices were trained with; it is read back from the text espeak consumed for that clause.
"""

from __future__ import annotations

import ctypes
import re
import threading
from pathlib import Path

from mizuoto.errors import ResourceError

_AUDIO_OUTPUT_SYNCHRONOUS = 2
_CHARS_UTF8 = 1
_PHONEMES_IPA = 0x02
_EE_OK = 0

_SENTENCE_END = set(".!?")
# espeak marks words it reads in another language as "(fr)...(en)"; Piper voices never saw those marks.
_LANGUAGE_FLAG = re.compile(r"\([a-z]{2,3}(?:-[a-z0-9]+)?\)")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_voice: str | None = None


def _library() -> ctypes.CDLL:
    """Load and initialise libespeak-ng once."""
    global _lib
    if _lib is not None:
        return _lib
    try:
        import espeakng_loader
    except ImportError as e:
        raise ResourceError("mizuoto-piper needs the espeakng-loader package (pip install espeakng-loader)") from e
    data = Path(espeakng_loader.get_data_path())
    try:
        lib = ctypes.CDLL(espeakng_loader.get_library_path())
    except OSError as e:
        raise ResourceError(f"cannot load libespeak-ng from {espeakng_loader.get_library_path()}: {e}") from e
    lib.espeak_Initialize.restype = ctypes.c_int
    lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.espeak_SetVoiceByName.restype = ctypes.c_int
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
    lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
    # The path is the folder that *contains* espeak-ng-data.
    if lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, str(data.parent).encode(), 0) < 0:
        raise ResourceError(f"libespeak-ng failed to initialise with data at {data}")
    _lib = lib
    return lib


def _set_voice(lib: ctypes.CDLL, voice: str) -> None:
    global _voice
    if voice == _voice:
        return
    if lib.espeak_SetVoiceByName(voice.encode()) != _EE_OK:
        raise ResourceError(f"espeak-ng has no voice {voice!r} (the voice's .onnx.json names it under espeak.voice)")
    _voice = voice


_CLOSERS = "\"')]}\u00bb\u201d\u2019 \t\r\n"
_TERMINATORS = set(".,;:!?")


def _clauses(lib: ctypes.CDLL, text: str) -> list[tuple[str, str]]:
    """(IPA, terminator) per clause as espeak-ng cuts the text; the terminator is "" when none ended it.

    espeak advances the text pointer past each clause plus one character of look-ahead, so the
    clause's own text is what lies between the two pointers less that last character.
    """
    raw = text.encode("utf-8")
    buf = ctypes.create_string_buffer(raw)
    base = ctypes.addressof(buf)
    ptr = ctypes.c_void_p(base)
    out = []
    while ptr.value:
        start = ptr.value - base
        ipa = lib.espeak_TextToPhonemes(ctypes.byref(ptr), _CHARS_UTF8, _PHONEMES_IPA)
        end = ptr.value - base if ptr.value else len(raw)
        consumed = raw[start:end].decode("utf-8", errors="ignore")
        if ptr.value:
            consumed = consumed[:-1]
        tail = consumed.rstrip(_CLOSERS)
        mark = tail[-1] if tail and tail[-1] in _TERMINATORS else ""
        phonemes = _LANGUAGE_FLAG.sub("", ipa.decode("utf-8")).strip() if ipa else ""
        out.append((phonemes, mark))
    return out


def phonemize(text: str, voice: str = "en-us") -> list[str]:
    """IPA phoneme strings, one per sentence, with clause punctuation kept as Piper expects."""
    sentences: list[str] = []
    current = ""
    with _lock:
        lib = _library()
        _set_voice(lib, voice)
        clauses = _clauses(lib, text)
    for phonemes, mark in clauses:
        current += phonemes + mark
        if mark in _SENTENCE_END:
            sentences.append(current.strip())
            current = ""
        else:
            current += " "
    if current.strip():
        sentences.append(current.strip())
    return [s for s in sentences if s.strip(" .,;:!?")]
