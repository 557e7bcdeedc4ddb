"""The Triton mode check: which way Triton kernels run on a device, and the reason recorded with it."""

from __future__ import annotations

import importlib.util

import pytest

from mlaserve.platform import triton_runtime
from mlaserve.platform.triton_runtime import triton_mode


def test_interpreter_runs_on_cpu_when_enabled(monkeypatch):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_mode("cpu").mode == "interpreter"
    assert triton_mode("cuda").mode == "interpreter"


def test_cpu_without_interpreter_is_refused_with_the_way_out(monkeypatch):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = triton_mode("cpu")
    assert m.mode is None and "TRITON_INTERPRET=1" in m.reason
    assert triton_mode("cuda").mode == "compiled"


def test_missing_package_is_named(monkeypatch):
    monkeypatch.setattr(triton_runtime.importlib.util, "find_spec", lambda name: None)
    m = triton_mode("cuda")
    assert m.mode is None and "triton package is not installed" in m.reason
