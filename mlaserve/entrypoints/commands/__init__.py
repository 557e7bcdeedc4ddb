"""The `mlaserve` subcommands, one module each: `add(sub)` declares a command's flags on the parser,
its function runs it (entrypoints/cli.py dispatches). `serve` lives with the server (entrypoints/openai/cli.py)."""
