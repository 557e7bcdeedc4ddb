"""`mlaserve inspect` on DeepSeek-V4: the kernels line says why the kernels are torch, and the reason is true of
the checkpoint (an FP8 / FP4-expert folder does hold quantized weights; a float folder holds none). The
settings themselves are unchanged: kernels torch (V4's holders have no native kernel), dtype float32."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from v4_models import save_hf_v4  # noqa: E402

from mlaserve.entrypoints.cli import main  # noqa: E402
from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.quant.writer import write_fp8_folder  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4_kernels_line")
    save_hf_v4("all_kinds", root / "float", seed=7)
    for experts in ("fp8", "fp4"):
        write_fp8_folder(root / "float", root / experts, block=(16, 16), keep_dtype=torch.float32, experts=experts)
    return root


def _line(out: str, name: str) -> str:
    return next(ln for ln in out.splitlines() if ln.lstrip().startswith(name))


@pytest.mark.parametrize("experts", ["fp8", "fp4"])
def test_a_quantized_folder_is_said_to_hold_quantized_weights(folders, experts, capsys):
    assert main(["inspect", str(folders / experts)]) == 0
    line = _line(capsys.readouterr().out, "kernels")
    assert "holds no quantized weights" not in line, line
    assert f"fp8 e4m3 weights (experts {experts}) stay quantized in DeepSeek-V4's holders" in line, line
    assert "run in torch" in line
    cfg = LLM(str(folders / experts)).config
    assert cfg.kernels.impl == "torch" and cfg.runtime.dtype == torch.float32  # the choices stand


def test_a_float_folder_holds_none(folders, capsys):
    assert main(["inspect", str(folders / "float")]) == 0
    line = _line(capsys.readouterr().out, "kernels")
    assert "the checkpoint holds no quantized weights" in line, line
