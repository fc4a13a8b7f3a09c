"""What the tests choose themselves, varied per run: `$MIZUOTO_TEST_SHIFT` (default 0) shifts it.

Recorded cases fix their own inputs; the requests a test makes up (a seed, a sentence) are its
own choice, and a test must hold for any such choice, not for the one it was written with. The
second-tree run in CI sets a shift, so each of those choices is another there.
"""

from __future__ import annotations

import os

SHIFT = int(os.environ.get("MIZUOTO_TEST_SHIFT", "0") or 0)
_MORE = " And then it says a little more."


def seed(n: int) -> int:
    """A seed a test picked, shifted for this run."""
    return n + 1009 * SHIFT


def text(words: str) -> str:
    """A text a test picked, a sentence longer per shift."""
    return words + _MORE * SHIFT
