"""benchmarks/profile_decode.py wraps named methods of mlaserve's classes in profiler scopes; a scope whose class or
method was renamed or moved would stop the script at start. Every scope must resolve to a function it can wrap."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_every_profile_scope_names_a_function(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("profile_decode", None)
    import profile_decode

    missing = []
    for mod_name, cls_name, meth, label in profile_decode.SCOPES:
        owner = importlib.import_module(mod_name)
        if cls_name:
            owner = getattr(owner, cls_name, None)
        found = owner is not None and (meth in owner.__dict__ if cls_name else callable(getattr(owner, meth, None)))
        if not found:
            missing.append(f"{mod_name}.{cls_name or ''}.{meth} ({label})")
    assert not missing, f"profile_decode.SCOPES names what no longer exists: {missing}"
