"""The MLA config.json reader (`Family.reader == "mla"`), one file per concern or family; config/model.py's
`ModelConfig.from_hf` composes them. Each reader takes the `RawConfig` (raw.py: the dict, its source, the family,
the provenance log) and returns a frozen piece of config/model_parts.py, recording where each value came from.

  raw.py            RawConfig: legacy and own key names translated, `get` (value or class default, recorded)
  checks.py         the raw fields' types before reading; the built config's values that cannot define a model
  wrapper.py        a multimodal wrapper's text_config (kimi_k25, glm5_next) read as the model served
  rope.py           the main rope (NoPE, default, yarn; the family's interleave rule)
  moe.py            the dense / MoE schedule and the router
  dsa.py            the lightning indexer (DSA families)
  longcat_flash.py  two attention sublayers per layer, the latent scales, identity experts
  kimi_linear.py    KDA layers and widths
  glm5_next.py      GLM-5.3-Flash's layout (config/glm5_next.py) applied over the DeepSeek-V3 fields
"""
