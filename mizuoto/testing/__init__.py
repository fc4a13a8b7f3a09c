"""Test support shipped with the package: fixture lookup and the engine contract suite."""
