"""The engine's thread count: automatic from the model's size, user-settable, recorded with its source."""

from __future__ import annotations

import warnings

import pytest
import torch

from mlaserve import LLM
from mlaserve.config.machine import SMALL_MODEL_PARAMS
from mlaserve.platform import threads as threads_mod


def _prov(llm):
    return {s.name: s for s in llm.config.all_provenance()}


def test_small_model_runs_one_thread_and_says_why(hf_model_dir):
    folder, ref = hf_model_dir("v3_yarn")
    llm = LLM(str(folder))
    n_params = sum(p.numel() for p in llm.runner.model.parameters())
    assert n_params < SMALL_MODEL_PARAMS
    assert llm.config.runtime.threads == 1 and torch.get_num_threads() == 1
    assert "auto" in _prov(llm)["threads"].source and "parameters" in _prov(llm)["threads"].source


def test_parameter_estimate_matches_the_built_model(hf_model_dir):
    """The thread rule reads a size estimated from the config: it must be the model's real size (<= 2%)."""
    for kind in ("v3_yarn", "v2_noq", "v32"):
        folder, _ = hf_model_dir(kind)
        llm = LLM(str(folder))
        real = sum(p.numel() for p in llm.runner.model.parameters())
        assert abs(llm.config.model.estimated_params() - real) <= 0.02 * real, kind


def test_user_threads_are_applied_and_recorded(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    before = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the busy-machine warning, when the test machine is busy
            llm = LLM(str(folder), threads=2)
        assert torch.get_num_threads() == 2 and _prov(llm)["threads"].source == "user option"
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        LLM(str(folder), threads=0)


def test_busy_machine_warns(monkeypatch):
    monkeypatch.setattr(threads_mod.os, "getloadavg", lambda: (3.0, 3.0, 3.0))
    monkeypatch.setattr(threads_mod, "usable_cores", lambda: 2)
    with pytest.warns(UserWarning, match="the machine is busy"):
        assert threads_mod.warn_if_busy(2) is not None
    assert threads_mod.warn_if_busy(1) is None  # one thread never waits for another
    monkeypatch.setattr(threads_mod.os, "getloadavg", lambda: (0.3, 0.3, 0.3))
    assert threads_mod.warn_if_busy(2) is None
