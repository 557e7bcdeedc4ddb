"""`mlaserve --help` answers without importing torch (it took ~2 s), and every flag has help text."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys
from mlaserve.entrypoints.cli import main
for argv in (["--help"], ["serve", "--help"], ["generate", "--help"]):
    try:
        main(argv)
    except SystemExit:
        pass
print("TORCH" if "torch" in sys.modules else "NO-TORCH")
"""


def test_help_does_not_import_torch():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("NO-TORCH"), out.stdout[-500:]
    assert "--enable-debug-endpoints" in out.stdout and "--top-k" in out.stdout


def test_every_flag_has_help():
    from mlaserve.entrypoints import cli

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    for add in cli.SUBCOMMANDS:
        add(sub)
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert action.help, f"mlaserve {name} {action.option_strings[0]} has no help text"
