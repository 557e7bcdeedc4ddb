"""The engine workers of benchmarks/offline.py: one engine each, in a process of its own (offline.py --worker
serves one of these over JSON lines; see offline_engines.py for the protocol, offline_phases.py for the run).

MlaServeWorker runs mlaserve (a folder or a GGUF), HFWorker transformers' AutoModelForCausalLM, LlamaCppWorker
llama.cpp through llama-cpp-python's low-level C API. Every worker answers the same calls (below)."""

from __future__ import annotations

import gc
import math
import sys
import time

from ik_llama_worker import IkLlamaWorker

PAGE_SIZE = 16


def proc_status_gib(field: str) -> float:
    """A /proc/self/status memory field (VmRSS, VmHWM) in GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    return float("nan")


# =====================================================================================================
# workers: one engine each, in its own process
# =====================================================================================================
# Every worker answers the same calls:
#   generate(prompts, new) -> {wall_s, first_s, rate_b1, ids}: wall_s the whole call, first_s the
#       time until every request has its first token (so wall_s - first_s is the decode phase),
#       rate_b1 (one prompt only) = (n-1) / (last token time - first token time), ids the first
#       request's output tokens (greedy).
#   kv_bytes() -> {...} | None;  step_times(contexts, reps, warmup) -> {context: ms} | None;
#   info() -> what the engine chose (provenance, versions).


class MlaServeWorker:
    def __init__(self, path: str, dtype: str, threads: int, s: dict, options: dict) -> None:
        import torch

        from mlaserve import LLM

        torch.set_num_threads(threads)
        need = max(
            max(s["concs"]) * math.ceil((s["conc_prompt"] + s["conc_new"]) / PAGE_SIZE),
            math.ceil((max(s["contexts"]) + 1) / PAGE_SIZE),
            math.ceil((s["long_prompt"] + s["long_new"]) / PAGE_SIZE),
            math.ceil((s["prefill_len"] + 1) / PAGE_SIZE),
        )
        kw = dict(
            dtype=dtype,
            page_size=PAGE_SIZE,
            # the step's token budget is the engine's default (1024 on the CPU), as the CLI and server run
            max_num_seqs=max(16, *s["concs"]),
            num_pages=need + 16,
            threads=threads,  # the benchmark's --threads
            malloc_tuning=True,  # as the CLI and server run
        )
        kw.update(options)
        self.llm = LLM(model=path, **kw)
        self.options = options

    def generate(self, prompts: list[list[int]], new: int) -> dict:
        from mlaserve.sampling.params import SamplingParams

        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
        wall = time.perf_counter() - t0
        cached = sum(o.metrics.get("num_cached_prompt_tokens", 0) or 0 for o in outs)
        if cached:
            raise RuntimeError(f"prefix cache hit ({cached} tokens): the prompts must be distinct")
        return {
            "wall_s": wall,
            "first_s": max(o.metrics["time_to_first_token"] for o in outs),
            "rate_b1": outs[0].metrics.get("tokens_per_s") if len(outs) == 1 else None,
            "ids": list(outs[0].outputs[0].token_ids),
        }

    def kv_bytes(self) -> dict:
        from mlaserve.cache.model_cache import ModelCache

        runner = self.llm.runner
        return {
            "measured": runner.cache.measured_bytes_per_token(),
            "formula": ModelCache.bytes_per_token(runner.layer_kinds, self.llm.config.runtime.dtype),
            "what": "allocated latent-cache tensor bytes / cache rows (all layers; [c_kv | k_pe] per token)",
        }

    def step_times(self, contexts: list[int], reps: int, warmup: int) -> dict:
        """Single-token decode forward over a synthetic cache at each context length."""
        from common import fill_mlaserve_cache, timed

        from mlaserve.executor.forward_batch import SeqChunk

        pool = self.llm.engine.pool
        pages = pool.allocate(math.ceil((max(contexts) + 1) / PAGE_SIZE))
        try:
            fill_mlaserve_cache(self.llm, pages, max(contexts))
            out = {}
            for n in contexts:
                chunk = SeqChunk("ctx", (5,), n, tuple(pages[: math.ceil((n + 1) / PAGE_SIZE)]))
                out[n] = timed(lambda: self.llm.runner.execute([chunk]), reps, warmup)["median_s"] * 1e3
        finally:
            pool.release(pages)
        gc.collect()
        return out

    def info(self) -> dict:
        import torch

        import mlaserve

        wanted = ("dtype", "threads", "kernels", "gguf_weights", "quantization", "attention", "mla_path")
        prov = {s.name: [str(s.value), s.source] for s in self.llm.config.all_provenance() if s.name in wanted}
        return {
            "mlaserve": getattr(mlaserve, "__version__", None),
            "torch": torch.__version__,
            "options": self.options,
            "provenance": prov,
        }


class _Stamps:
    """A logits processor that records when each generation step's logits arrive."""

    def __init__(self) -> None:
        self.t: list[float] = []

    def __call__(self, input_ids, scores):
        self.t.append(time.perf_counter())
        return scores


class HFWorker:
    def __init__(self, path: str, dtype: str, threads: int, s: dict, options: dict) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        from mlaserve.platform.allocator import keep_freed_memory

        keep_freed_memory()  # the allocator policy the mlaserve engines run with (malloc_tuning=True): same for both
        self.model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype), output_loading_info=True
        )
        bad = {k: v for k, v in info.items() if v}
        if bad:
            raise RuntimeError(f"transformers did not load the folder cleanly: {bad}")
        self.model.eval()
        self.kv = None

    def generate(self, prompts: list[list[int]], new: int) -> dict:
        import torch
        from transformers import LogitsProcessorList

        # left padding + attention mask (a no-op when all prompts have the same length, as here)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), 2, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        st = _Stamps()
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=2, return_dict_in_generate=True)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, logits_processor=LogitsProcessorList([st]), **kw
            )
        wall = time.perf_counter() - t0
        if len(prompts) == 1 and self.kv is None:
            cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
            self.kv = self._kv_bytes(cache, 1)
        return {
            "wall_s": wall,
            "first_s": st.t[0] - t0,
            "rate_b1": (len(st.t) - 1) / (st.t[-1] - st.t[0]) if len(prompts) == 1 and len(st.t) > 1 else None,
            "ids": out.sequences[0, width:].tolist(),
        }

    @staticmethod
    def _kv_bytes(cache, batch: int) -> dict:
        total, seq = 0, None
        for layer in cache.layers:
            for t in (layer.keys, layer.values):
                total += t.numel() * t.element_size()
            seq = layer.get_seq_length()
        shapes = [tuple(cache.layers[0].keys.shape), tuple(cache.layers[0].values.shape)]
        return {
            "measured": total // (batch * seq),
            "cached_tokens": seq,
            "layer0_shapes": shapes,
            "what": "sum over DynamicCache layers of keys+values bytes / (batch * cached tokens)",
        }

    def kv_bytes(self) -> dict | None:
        return self.kv

    def step_times(self, contexts: list[int], reps: int, warmup: int) -> dict:
        """The same synthetic rows as mlaserve's (same generator, same order, same norm weights)."""
        import torch
        from common import synthetic_latent_rows, timed
        from transformers import DynamicCache

        cfg = self.model.config
        r, n_max = cfg.kv_lora_rank, max(contexts)
        dtype = self.model.dtype
        g = torch.Generator().manual_seed(1)
        rows = {}
        for i, layer in enumerate(self.model.model.layers):
            attn = layer.self_attn
            shim = type("Attn", (), {})()
            shim.cfg = type("Cfg", (), {"kv_lora_rank": r, "qk_rope_head_dim": cfg.qk_rope_head_dim})()
            shim.kv_a_layernorm = attn.kv_a_layernorm
            rows[i] = synthetic_latent_rows(n_max, shim, dtype, g)
        out = {}
        for n in contexts:
            cache = DynamicCache(config=cfg)
            for i in range(cfg.num_hidden_layers):
                lat = rows[i][:n]
                cache.update(lat[:, :r].reshape(1, 1, n, r).clone(), lat[:, r:].reshape(1, 1, n, -1).clone(), i)
            ids, pos = torch.tensor([[5]]), torch.tensor([[n]])

            def step(cache=cache, ids=ids, pos=pos):
                with torch.inference_mode():
                    self.model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
                cache.crop(-1)  # back to n tokens: every timed step sees the same context

            out[n] = timed(step, reps, warmup)["median_s"] * 1e3
            assert cache.get_seq_length() == n
        del rows
        gc.collect()
        return out

    def info(self) -> dict:
        import torch
        import transformers

        cfg = self.model.config
        return {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "attn_implementation": cfg._attn_implementation,
            "experts_implementation": getattr(cfg, "_experts_implementation", None),
        }


class LlamaCppWorker:
    """llama.cpp through llama-cpp-python's low-level C API (no torch in this process): one context per
    batch shape (n_seq_max = the number of requests, n_ctx = n_seq_max x the padded per-request
    length), all prompts decoded in one batch (split at n_batch tokens), then one token per
    sequence per llama_decode until done, greedy (argmax of each sequence's logits): the scheme
    of llama.cpp's `llama-batched-bench`."""

    N_BATCH, N_UBATCH = 2048, 512  # llama.cpp's defaults

    def __init__(self, path: str, dtype: str, threads: int, s: dict, options: dict) -> None:
        import llama_cpp as lc
        import numpy as np

        self.lc, self.np, self.threads = lc, np, threads
        self._keep_log = lc.llama_log_callback(self._log)
        lc.llama_log_set(self._keep_log, None)
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        if "repack" in options:  # llama-bench's --repack: AMX / repacked weight buffers (extra buffer types)
            mp.use_extra_bufts = bool(options["repack"])
        self.model = lc.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path} (its log above says why)")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.ctx, self.ctx_shape, self.batch = None, None, None
        # how the weights are read (mmap by default; the field names differ across versions)
        self.model_params = {
            k: getattr(mp, k)
            for k in ("use_mmap", "use_mlock", "load_mode", "lazy_mode", "use_extra_bufts")
            if hasattr(mp, k)
        }

    @staticmethod
    def _log(level, text, user_data) -> None:
        if level in (3, 4):  # GGML_LOG_LEVEL_WARN, _ERROR
            sys.stderr.write("[llama.cpp] " + text.decode(errors="replace"))

    def _context(self, n_seq: int, per_seq: int):
        lc = self.lc
        per_seq = -(-per_seq // 256) * 256
        if self.ctx_shape != (n_seq, per_seq):
            if self.ctx is not None:
                lc.llama_free(self.ctx)
                lc.llama_batch_free(self.batch)
                self.ctx = None
            cp = lc.llama_context_default_params()
            cp.n_ctx = n_seq * per_seq
            cp.n_batch, cp.n_ubatch, cp.n_seq_max = self.N_BATCH, self.N_UBATCH, n_seq
            cp.n_threads = cp.n_threads_batch = self.threads
            cp.no_perf = True
            self.ctx = lc.llama_init_from_model(self.model, cp)
            if not self.ctx:
                raise RuntimeError(f"llama_init_from_model failed (n_ctx {cp.n_ctx}, n_seq_max {n_seq})")
            self.batch = lc.llama_batch_init(self.N_BATCH, 0, 1)
            self.ctx_shape = (n_seq, per_seq)
            self.ctx_params = {
                "n_ctx": cp.n_ctx,
                "n_batch": cp.n_batch,
                "n_ubatch": cp.n_ubatch,
                "n_seq_max": cp.n_seq_max,
                "flash_attn_type": cp.flash_attn_type,
                "kv_unified": bool(cp.kv_unified),
                "type_k": cp.type_k,
                "type_v": cp.type_v,
            }
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        return self.ctx

    def _decode(self, ctx, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, pos, seq, wants logits); one llama_decode per n_batch items. Returns the
        argmax token of every item that wants logits, in order (read before the next call)."""
        lc, b, np = self.lc, self.batch, self.np
        picks = []
        for start in range(0, len(items), self.N_BATCH):
            part = items[start : start + self.N_BATCH]
            for i, (tok, pos, seq, out) in enumerate(part):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(out)
                b.seq_id[i][0] = seq
            b.n_tokens = len(part)
            rc = lc.llama_decode(ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            for i, item in enumerate(part):
                if item[3]:
                    logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,))
                    picks.append(int(logits.argmax()))
        return picks

    def generate(self, prompts: list[list[int]], new: int) -> dict:
        ctx = self._context(len(prompts), max(len(p) for p in prompts) + new)
        t0 = time.perf_counter()
        items = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        out = [[t] for t in self._decode(ctx, items)]  # one logits row per sequence, in sequence order
        t_first = time.perf_counter()
        for step in range(1, new):
            picks = self._decode(ctx, [(out[s][-1], len(p) + step - 1, s, True) for s, p in enumerate(prompts)])
            for s, t in enumerate(picks):
                out[s].append(t)
        t_end = time.perf_counter()
        return {
            "wall_s": t_end - t0,
            "first_s": t_first - t0,
            "rate_b1": (new - 1) / (t_end - t_first) if len(prompts) == 1 and new > 1 else None,
            "ids": out[0],
        }

    def kv_bytes(self) -> None:
        return None

    def step_times(self, contexts, reps, warmup) -> None:
        return None  # no synthetic cache fill through the C API: see the decode row at long context

    def info(self) -> dict:
        return {
            "llama_cpp_python": getattr(self.lc, "__version__", None),
            "system_info": self.lc.llama_print_system_info().decode(errors="replace").strip(),
            "model_params": self.model_params,
            "context_params": getattr(self, "ctx_params", None),
        }


WORKERS = {
    "mlaserve": MlaServeWorker,
    "mlaserve-gguf": MlaServeWorker,
    "transformers": HFWorker,
    "llama.cpp": LlamaCppWorker,
    "ik_llama.cpp": IkLlamaWorker,
}


def rss() -> dict:
    return {"vmrss_gib": proc_status_gib("VmRSS"), "vmhwm_gib": proc_status_gib("VmHWM")}
