"""DeepSeek-V4 (transformers' DeepseekV4ForCausalLM), one concept per file:

rope.py        the two rope tables (main; compress theta + YaRN) and the interleaved trailing-dims rotation
compressor.py  pooling of projected rows into compressed rows (CSA overlapping 2m, HCA non-overlapping m')
indexer.py     the CSA lightning indexer: its own compressor, the scorer, top-k under the causal rule
attention.py   query LoRA + unweighted per-head norm, the shared K=V head, sliding window + compressed rows,
               sinks, output de-rotation, grouped low-rank output projection
hyper.py       mHC: hc_mult residual streams, Sinkhorn-normalised mixing, the head collapse
moe.py         sqrt-softplus router (learned or hash), SwiGLU experts clamped at swiglu_limit
state.py       the per-sequence state of each layer kind (ring window, compressed pools, compressor carry)
model.py       the stack: one forward over chunks of one or more sequences, continuing their states
serving.py     the engine's model: each sequence's state as views of its cache slot (request states)
norm.py        the weighted (fp32) and unweighted RMSNorms
Its checkpoints load through loading/deepseek_v4.py (released and save_pretrained layouts, strictly).
"""
