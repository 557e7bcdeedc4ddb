"""docs/OPTIONS.md, generated from EngineOptions (the one home of every option's default and help).

    python -m mlaserve.entrypoints.options_doc > docs/OPTIONS.md

Each option's default, help text and vocabulary come from config/engine.py; its command-line flag
comes from the parser that engine_args.add_engine_args builds (the one generate, inspect, verify and
serve use), so the page says what the code accepts. tests/unit/test_docs.py fails when the file and
render() differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from mlaserve.config.engine import EngineOptions
from mlaserve.entrypoints.engine_args import add_engine_args, engine_options

REGENERATE = "python -m mlaserve.entrypoints.options_doc > docs/OPTIONS.md"


def _literal(value) -> str:
    """A value as one writes it in Python: "auto", 16, None, True."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlaserve generate")
    add_engine_args(p)
    return p


def _flags(p: argparse.ArgumentParser) -> tuple[dict[str, argparse.Action], list[argparse.Action]]:
    """The engine options' flags by option name (a `--no-NAME` switch counts for NAME), and the other flags."""
    names = {f.name for f in dataclasses.fields(EngineOptions)}
    by_name, others = {}, []
    for a in p._actions:
        if not a.option_strings or isinstance(a, argparse._HelpAction):
            continue
        name = a.dest.removeprefix("no_") if a.dest not in names else a.dest
        if name in names:
            by_name[name] = a
        else:
            others.append(a)
    return by_name, others


def render() -> str:
    p = _parser()
    flags, others = _flags(p)
    cli_defaults = engine_options(p.parse_args([]))
    lines = [
        "# Engine options",
        "",
        "<!-- Generated from mlaserve.config.engine.EngineOptions; do not edit by hand. Regenerate with",
        f"     {REGENERATE}",
        "     (tests/unit/test_docs.py fails when this file and the generator differ). -->",
        "",
        "Every engine option has one home, `mlaserve.EngineOptions` (its default and help text): `LLM(...)` takes",
        "them as keywords and every `mlaserve` subcommand that loads a model (generate, inspect, verify, serve) takes",
        'them as flags; `mlaserve inspect` shows each value and where it came from. `"auto"` / `None` let the',
        "engine decide, and it records why.",
        "",
        "| option | default | values | flag | meaning |",
        "|---|---|---|---|---|",
    ]
    for f in dataclasses.fields(EngineOptions):
        choices = f.metadata.get("choices")
        values = ", ".join(f"`{_literal(c)}`" for c in choices) if choices else _cell(f"`{f.type}`")
        a = flags.get(f.name)
        if a is None:
            flag = "-"
        else:
            flag = " / ".join(f"`{s}`" for s in a.option_strings)
            cli_default = cli_defaults.get(f.name, f.default)
            if cli_default != f.default:
                flag += f" (the CLI's default: `{_literal(cli_default)}`)"
        lines.append(f"| `{f.name}` | `{_literal(f.default)}` | {values} | {flag} | {_cell(f.metadata['help'])} |")
    lines += ["", "Flags of the same subcommands that are not engine options:", ""]
    for a in others:
        metavar = f" {a.metavar}" if a.metavar else (" PATH" if a.dest == "model" else "")
        help_text = (a.help or "").replace("%%", "%")
        lines.append(f"- `{' / '.join(a.option_strings)}{metavar}`: {help_text}")
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
