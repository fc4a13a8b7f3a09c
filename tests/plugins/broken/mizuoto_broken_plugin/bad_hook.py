"""Imports fine, but its hook raises."""

from mizuoto.runtime.hookspecs import hookimpl


@hookimpl
def mizuoto_engines() -> list:
    """Raise, as a plugin with a bug would."""
    raise RuntimeError("deliberately broken hook")
