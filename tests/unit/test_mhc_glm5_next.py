"""mHC shared by DeepSeek-V4 and GLM-5.3-Flash (models/deepseek_v4/hyper.py): the block mixing against transformers
5.24's Glm5NextTextHyperConnection on the same weights, and the final collapse chosen by the config field
V4HyperConnections.learned_head (GLM: the unweighted mean, Glm5NextTextHyperHead; V4: learned weights).

Bound: 1e-6 max abs on post / comb / collapsed values of magnitude <= ~4 (fp32; measured 0: the same ops in the
same order, the bound leaves room for another summation order of the flattened norm and the fn product). The
pre weights without their hc_eps (1e-6; broken on purpose) moved `collapsed` by 6.2e-6: failed.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve.config.deepseek_v4_parts import V4HyperConnections
from mlaserve.models.deepseek_v4.hyper import HyperConnection, HyperHead, MeanHead, make_head

BOUND = 1e-6


@pytest.mark.parametrize("n, iters", [(4, 20), (3, 7)])
def test_the_block_mixing_equals_transformers(n, iters):
    tf = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    from transformers import Glm5NextTextConfig

    hidden, eps = 24, 1e-5
    cfg = Glm5NextTextConfig(hidden_size=hidden, hc_mult=n, hc_sinkhorn_iters=iters, rms_norm_eps=eps, q_lora_rank=16)
    ref = tf.Glm5NextTextHyperConnection(cfg)
    ours = HyperConnection(hidden, V4HyperConnections(n, iters, cfg.hc_eps, learned_head=False), eps)
    g = torch.Generator().manual_seed(n)
    with torch.no_grad():
        for name in ("fn", "base", "scale"):
            value = torch.randn(getattr(ref, name).shape, generator=g) * 0.3
            getattr(ref, name).copy_(value)
            getattr(ours, name).copy_(value)
    h = torch.randn(1, 29, n, hidden, generator=g)
    with torch.no_grad():
        want = ref(h)
        got = ours(h[0])
    for name, a, b in zip(("post", "comb", "collapsed"), got, want):
        err = (a - b[0]).abs().max().item()
        assert err <= BOUND, f"{name}: max abs {err:.3g}"
    head = make_head(hidden, ours_cfg := V4HyperConnections(n, iters, cfg.hc_eps, learned_head=False), eps)
    assert isinstance(head, MeanHead) and not list(head.parameters())
    assert torch.equal(head(h[0]), tf.Glm5NextTextHyperHead()(h)[0])
    assert isinstance(make_head(hidden, V4HyperConnections(n, iters, ours_cfg.eps), eps), HyperHead)  # V4's default
