"""The rollback protocol (models/rollback.py) is the model's: every model that says it rolls back its request states
(`rolls_back`) supplies `verify_tape` and `rollback` with the protocol's parameters, and the runner names no model's
tape (it asks the model). Kimi-Linear's model (MLAForCausalLM with KDA layers) does not roll back."""

from __future__ import annotations

import inspect

import mlaserve.executor.model_runner as model_runner
from mlaserve.models.deepseek import MLAForCausalLM
from mlaserve.models.deepseek_v4.serving import V4Serving
from mlaserve.models.glm5_next import Glm5NextForCausalLM
from mlaserve.models.rollback import RollsBack


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_the_models_that_roll_back_implement_the_protocol():
    for cls in (V4Serving, Glm5NextForCausalLM):
        assert "rolls_back" in dir(cls), cls.__name__
        for method in ("verify_tape", "rollback"):
            assert _params(getattr(cls, method)) == _params(getattr(RollsBack, method)), (cls.__name__, method)
        assert "tape" in _params(cls.forward), cls.__name__  # the forward takes the tape the layers fill
    assert Glm5NextForCausalLM.rolls_back is True
    assert not getattr(MLAForCausalLM, "rolls_back", False)  # Kimi-Linear: speculation refused by its state


def test_the_runner_names_no_models_tape():
    source = inspect.getsource(model_runner)
    assert "RollbackTape" not in source and "KDATape" not in source
    assert "self.model.verify_tape(" in source and "self.model.rollback(" in source
