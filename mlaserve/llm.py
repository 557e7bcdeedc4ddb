"""The offline API: LLM(model=PATH, ...).prompt_logits(ids) and .generate(prompts, params)."""

from __future__ import annotations

import torch

from .engine_config import EngineOptions
from .forward_batch import SeqChunk
from .kv_cache import PagePool
from .loading.model_loader import load_model
from .model_runner import ModelRunner
from .trace import make_tracer


class LLM:
    def __init__(self, model: str, dtype: str | None = None, attention: str = "auto", mla_path: str = "auto",
                 page_size: int = 16, max_num_batched_tokens: int = 2048, trace=None, **options) -> None:
        opts = EngineOptions(dtype=dtype, attention=attention, mla_path=mla_path, page_size=page_size,
                             max_num_batched_tokens=max_num_batched_tokens, **options)
        self.loaded = load_model(model, opts)
        self.config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.runner = ModelRunner(self.loaded.model, self.config, make_tracer(trace))
        self.pool = PagePool(self.config.num_pages)

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Next-token logits at every prompt position [len, vocab] (float32), through the paged cache,
        in chunks of max_num_batched_tokens like a real prefill."""
        ps = self.config.page_size
        pages = self.pool.allocate(-(-len(token_ids) // ps))
        try:
            out, done = [], 0
            while done < len(token_ids):
                chunk = tuple(token_ids[done : done + self.config.max_num_batched_tokens])
                table = tuple(pages[: -(-(done + len(chunk)) // ps)])
                _, logits = self.runner.execute([SeqChunk("prompt", chunk, done, table, all_logits=True)])
                out.append(logits)
                done += len(chunk)
            return torch.cat(out)
        finally:
            self.pool.release(pages)
