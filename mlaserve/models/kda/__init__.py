"""Kimi Delta Attention (KDA): the linear-attention layers of Kimi-Linear, one file per concept.

recurrence.py  the gated delta rule: the plain token-by-token reference, the chunked form (prefill) and the
               batched one-token step (decode)
conv.py        the causal depthwise short convolution over q, k, v and its state (the last K - 1 inputs)
layer.py       KimiDeltaAttention: projections, conv, gates, recurrence, gated RMSNorm output, over the cache's
               request states (config/layer_kinds.py: "recurrent" and "conv", one slot per running request)
"""
