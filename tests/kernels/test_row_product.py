"""A weight's decode-sized product bound once (kernels/row_product.py): the same C entry and the same bits as
ggml.linear_native for every type, activation setting and row count up to GEMV_ROWS, and a GGUFLinear binds it
again when its weight or setting changes (the loader fills the weight after the plan; tests switch settings)."""

from __future__ import annotations

import pytest
import torch
from test_kernels import SCALE_BYTES, needs_native, random_blocks

from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import ggml, native, row_product
from mlaserve.quant.ggml_linear import GGUFLinear

pytestmark = needs_native
K, N = 512, 48
# fp32 (False), int8 caps (4, 6, 8, True: every type that has int8 kernels), int16 for the rest where the build has it
SETTINGS = [False, 4, 6, 8, True, 6 | native.INT16_REST, 4 | native.INT16_REST]


@pytest.mark.parametrize("name", sorted(SCALE_BYTES))
@pytest.mark.parametrize("setting", SETTINGS)
def test_bound_product_equals_linear_native(name, setting):
    g = torch.Generator().manual_seed(7)
    t = GGML_TYPE_IDS[name]
    w = random_blocks(name, N, K, g)
    product = row_product.bind(w, t, K, setting)
    for rows in (1, 3, ggml.GEMV_ROWS):
        x = torch.randn(rows, K, generator=g)
        want = ggml.linear_native(x, w, t, K, setting)
        assert torch.equal(product(x), want), (name, setting, rows)


def test_the_holder_binds_again_when_its_weight_or_setting_changes():
    g = torch.Generator().manual_seed(3)
    t = GGML_TYPE_IDS["Q8_0"]
    lin = GGUFLinear(K, N, t, bias=False, dtype=torch.float32, device="cpu")
    lin.kernel = "native"
    lin.weight.data.copy_(random_blocks("Q8_0", N, K, g))  # finite scales (the holder starts uninitialized)
    x = torch.randn(2, K, generator=g)
    for setting in (False, 8, 6 | native.INT16_REST):
        lin.int8 = setting  # a new setting: bound again
        assert torch.equal(lin(x), ggml.linear_native(x, lin.weight, t, K, setting)), setting
        lin.weight.data = random_blocks("Q8_0", N, K, g)  # a new tensor at a new address, as a load fills it
        assert torch.equal(lin(x), ggml.linear_native(x, lin.weight, t, K, setting)), setting
        lin.weight.data.copy_(random_blocks("Q8_0", N, K, g))  # new bytes at the same address: read, not cached
        assert torch.equal(lin(x), ggml.linear_native(x, lin.weight, t, K, setting)), setting
