"""The `mizuoto` command line: subcommands over the Runtime (say, models, engines, serve, bench)."""
