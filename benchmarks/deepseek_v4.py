"""DeepSeek-V4: mlaserve vs transformers on one V4-Flash-shaped model, scaled down to a 2-core CPU machine.

    python benchmarks/deepseek_v4.py [--threads 2] [--reps 3] [--contexts 1024 [16384]] [--quick]
        [--engines mlaserve transformers mlaserve-per-seq mlaserve-per-seq-state mlaserve-gguf
                   mlaserve-gguf-int8 llama.cpp]
        [--cases prefill decode concurrent] [--profile] [--mtp] [--weights float|fp8|fp4] [--llama-extra-bufts]
mlaserve-gguf and llama.cpp run the same model's Q8_0 GGUF, written once beside the folder by `mlaserve convert`
(llama.cpp's deepseek4 layout): mlaserve with its blocks kept (native kernels), llama.cpp through
llama-cpp-python's C API (its 8-bit activations; extra weight buffers off, see LlamaCpp); mlaserve-gguf-int8 is
mlaserve-gguf with activations="int8" (Q8_0's products on int8 activations, llama.cpp's arithmetic, not exact).
mlaserve-per-seq is mlaserve with the per-sequence reference softmax in place of the step's padded one
(the before/after of the batched attention); mlaserve-per-seq-state is mlaserve with the per-sequence reference
state updates (ring, compressors, indexer keys: V4Serving(batched_state=False)) in place of the step's batched
ones (the before/after of models/deepseek_v4/step_update.py). --profile: each mlaserve engine's 16-concurrent
decode steps under cProfile once, its time per function of the step (attention's parts, the MoE, ...).
--weights fp8 | fp4: the same model written by the project's writer as a DeepSeek FP8 folder (e4m3 128x128
blocks, fp32 scales; routed experts FP8 or packed FP4 as released; embeddings, head, router, compressors float)
and run kept quantized by the engines mlaserve (kernels auto: the native kernels on the holders, the KernelPlan's
choice), mlaserve-torch (kernels="torch": each holder dequantized by torch per call, routed experts batched) and
mlaserve-loop (kernels="torch" with the routed experts' plain reference loop, one pass per expert: what ran before
the holders had native kernels and a batched path); transformers does not read these folders.

The model (random weights, seed 0, written once by transformers' save_pretrained under benchmarks/models/):
V4-Flash's per-layer shape with the widths scaled down and its kinds kept: the 512-d shared K=V head, 64-d
rope tail, sliding window 128, CSA ratio 4 with an indexer of 64 heads x 128 keeping top 512, HCA ratio 128,
mHC with 4 streams, sqrt-softplus routing over 64 routed experts (top 6) plus a shared one, a hash-routed
first layer; hidden 1024 (Flash: 4096), 16 heads (64), q/o LoRA 512 (1024), 4 layers (sliding, CSA, HCA,
CSA; Flash has 43). Both engines run the same folder in float32 with the same torch thread count.

Measured, engines alternated within every repetition (the order flips each rep), median and spread (min-max)
over the reps:
  prefill 512    one 512-token prompt, first token (mlaserve: one step; transformers: one forward, cache on)
  prefill @N     batch 1, the N-token prompt of decode @N up to its first token, timed once per engine (a 16K
                 prefill takes many minutes here). mlaserve prefills in its 2048-token chunks; transformers in
                 --hf-chunk-token forwards with the cache (one 16K forward would build [16, 16K, 20K] fp32
                 attention scores and a [16K, 64, 4K] indexer product: tens of GB)
  decode @N      batch 1, context N: each engine prefills the N-token prompt once and keeps its cache; each rep
                 then times 8 more decode steps of that same request (the mean step), engines alternated, so
                 rep r decodes at context N + 8r (+1). The first greedy token of each engine is recorded: equal
                 tokens say both engines ran the same model over the same context
  16 concurrent  16 requests of 128 tokens, then 8 decode steps with all 16 in the step (transformers: one
                 batch of 16, no padding needed as the lengths are equal)
The KV bytes per token at 128K context are computed from the config for V4's cache (growing compressed rows +
the fixed ring and carry state spread over the context) and for a DeepSeek-V3.2 layout of the same width and
depth (latent 512 + rope 64 and one 128-d index key per token per layer), bf16 values; the ratio is reported
for this model and for V4-Flash's own 43 layers. The machine is shared: the JSON keeps the CPU flags and the
load average before and after, and every raw timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MODELS_DIR, RESULTS_DIR, environment, fmt, print_table, random_prompt, write_json  # noqa: E402

CSA, HCA, SW = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
# V4-Flash (config.json of the release, through transformers' field names), widths kept where they set the cache
FLASH = dict(layers=43, kinds={SW: 2, CSA: 21, HCA: 20}, head_dim=512, index_head_dim=128, window=128, csa=4, hca=128)
MODEL = dict(
    vocab_size=16384,
    hidden_size=1024,
    num_hidden_layers=4,
    layer_types=[SW, CSA, HCA, CSA],
    num_attention_heads=16,
    head_dim=512,
    partial_rotary_factor=64 / 512,
    q_lora_rank=512,
    o_groups=4,
    o_lora_rank=512,
    sliding_window=128,
    compress_rates={CSA: 4, HCA: 128},
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    n_routed_experts=64,
    num_experts_per_tok=6,
    moe_intermediate_size=256,
    num_hash_layers=1,
    hc_mult=4,
    max_position_embeddings=20480,
    bos_token_id=0,
    eos_token_id=1,
)
DECODE_STEPS = 8


def ensure_v4_model(quick: bool) -> Path:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = dict(MODEL, num_hidden_layers=3, layer_types=[SW, CSA, HCA]) if quick else MODEL
    folder = MODELS_DIR / f"v4-flash-shaped-l{cfg['num_hidden_layers']}-seed0"
    stamp = folder / "bench_config.json"
    if stamp.exists() and json.loads(stamp.read_text()) == cfg:
        return folder
    print(f"[build] writing the random V4 model to {folder} ...", flush=True)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg)).float()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # transformers' init zeroes sinks, biases and tid2eid: routing would not spread
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "embed" in name else p.shape[-1] ** -0.5))
            elif "norm" in name or name.endswith("scale"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                e = cfg["n_routed_experts"]
                b.copy_(torch.stack([torch.randperm(e, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))
    model.save_pretrained(folder)
    stamp.write_text(json.dumps(cfg))
    return folder


def ensure_v4_mtp_model(folder: Path) -> Path:
    """`folder`'s trunk plus a random MTP layer (`mtp.0.*` under the module names, as tests/v4_mtp_models.py
    writes them): a sliding-window decoder layer built by transformers (layer N of a model one layer deeper,
    the same init as the trunk's), e_proj / h_proj / norms and the hc head. Random, so its drafts are ~never
    accepted: the row measures what useless drafts cost (the acceptance switch pauses them)."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

    cfg = json.loads((folder / "bench_config.json").read_text())
    out = folder.with_name(folder.name + "-mtp")
    stamp = out / "bench_config.json"
    if stamp.exists() and json.loads(stamp.read_text()) == cfg:
        return out
    print(f"[build] writing the V4 model with a random MTP layer to {out} ...", flush=True)
    n = cfg["num_hidden_layers"]
    deeper = DeepseekV4Config(**dict(cfg, num_hidden_layers=n + 1, layer_types=cfg["layer_types"] + [SW]))
    torch.manual_seed(1)
    block = DeepseekV4DecoderLayer(deeper, n).float()
    g = torch.Generator().manual_seed(1)
    d, hc = cfg["hidden_size"], cfg["hc_mult"]
    with torch.no_grad():  # the trunk's init (ensure_v4_model)
        for name, p in block.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            elif "norm" in name or name.endswith("scale"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    extras = {
        "e_proj.weight": torch.randn(d, d, generator=g) * d**-0.5,
        "h_proj.weight": torch.randn(d, d, generator=g) * d**-0.5,
        "enorm.weight": 1 + 0.1 * torch.randn(d, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(d, generator=g),
        "norm.weight": 1 + 0.1 * torch.randn(d, generator=g),
        "hc_head.hc_fn": torch.randn(hc, hc * d, generator=g) * (hc * d) ** -0.5,
        "hc_head.hc_base": 0.1 * torch.randn(hc, generator=g),
        "hc_head.hc_scale": 1 + 0.1 * torch.randn(1, generator=g),
    }
    mtp = {f"mtp.0.{k}": v.detach().contiguous().clone() for k, v in (block.state_dict() | extras).items()}
    out.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.name not in ("model.safetensors", "config.json", "bench_config.json"):
            (out / f.name).write_bytes(f.read_bytes())
    save_file(load_file(folder / "model.safetensors") | mtp, out / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(raw, num_nextn_predict_layers=1)))
    stamp.write_text(json.dumps(cfg))
    return out


def kv_bytes_per_token(kinds: dict, head_dim: int, index_dim: int, window: int, csa: int, hca: int, ctx: int):
    """(V4, V3.2 layout of the same width and depth) bytes per token at `ctx` tokens, bf16 values.
    V4: CSA keeps a [512] row and a [128] index key per m tokens, HCA a [512] row per m' tokens; every layer a
    ring of `window` rows; the carries (CSA: open window kv+gate of both compressors and their overlap halves,
    HCA: the open window's kv+gate) are fixed per sequence and spread over ctx. V3.2: latent 512 + rope 64 and
    one index key per token per layer."""
    layers = sum(kinds.values())
    ring = window * head_dim * layers
    csa_fixed = csa * (4 * head_dim + 4 * index_dim) + csa * (2 * head_dim + 2 * index_dim)
    fixed = ring + kinds.get(CSA, 0) * csa_fixed + kinds.get(HCA, 0) * hca * 2 * head_dim
    grow = kinds.get(CSA, 0) * (head_dim + index_dim) / csa + kinds.get(HCA, 0) * head_dim / hca
    v4 = 2 * (grow + fixed / ctx)
    v32 = 2 * (head_dim + 64 + index_dim) * layers
    return v4, v32


def _spread(ts: list[float]) -> dict:
    return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "all_s": ts}


def ensure_v4_quantized(folder: Path, experts: str) -> Path:
    """`folder` written as a DeepSeek FP8 folder (quant/writer.py: e4m3 128x128 blocks, fp32 scales; the routed
    experts FP8 or FP4 as `experts` says), once, beside it."""
    from mlaserve.quant.writer import write_fp8_folder

    out = folder.with_name(f"{folder.name}-fp8-experts-{experts}")
    stamp = out / "bench_config.json"
    if stamp.exists() and stamp.read_text() == (folder / "bench_config.json").read_text():
        return out
    print(f"[build] writing {out.name} ...", flush=True)
    write_fp8_folder(folder, out, block=(128, 128), keep_dtype=torch.float32, experts=experts)
    stamp.write_text((folder / "bench_config.json").read_text())
    return out


class Mlaserve:
    name = "mlaserve"

    def __init__(
        self,
        folder: Path,
        batched: bool = True,
        batched_state: bool = True,
        mtp: bool = False,
        kernels: str = "auto",
        expert_loop: bool = False,
        name: str = "",
        activations: str = "auto",
    ) -> None:
        from mlaserve.entrypoints.llm import LLM
        from mlaserve.models.deepseek_v4.serving import v4_implementation

        spec = {"speculative": "mtp"} if mtp else {}
        if kernels != "auto":
            spec["kernels"] = kernels
        if activations != "auto":
            spec["activations"] = activations
        # threads: the engine sets torch's process-wide pool at load (default: every core), so the benchmark's
        # --threads must reach it, or it would also change the thread count of the transformers engine
        threads = torch.get_num_threads()
        self.llm = LLM(
            str(folder), dtype="float32", threads=threads, max_num_seqs=16, max_num_batched_tokens=2048, **spec
        )
        self.tokens_per_step: list[float] = []  # decode(): tokens out per timed step (> batch with accepted drafts)
        if mtp:
            self.name = "mlaserve-mtp"
        if kernels == "torch":
            self.name = "mlaserve-torch"
        if expert_loop:  # the quantized routed experts' plain reference loop (their `reference`), for before/after
            self.name = "mlaserve-loop"
            for m in self.llm.runner.model.modules():
                if hasattr(m, "reference") and hasattr(m, "routed"):
                    m.__dict__["routed"] = m.reference
        plan = self.llm.loaded.kernel_plan
        self.kernels = sorted({f"{c.op} {c.impl}" for c in plan.choices}) if plan is not None else []
        if name:
            self.name = name
        if not batched:  # the per-sequence reference softmax (models/deepseek_v4/attention.py), for before/after
            self.name = "mlaserve-per-seq"
            for layer in self.llm.runner.model.inner.model.layers:
                layer.self_attn.batched = False
        if not batched_state:  # the per-sequence reference state updates (V4Serving), for before/after
            self.name = "mlaserve-per-seq-state"
            model = self.llm.runner.model
            model.batched_state = False
            model.v4_implementation = v4_implementation(model.batched_attention, False)

    def _run(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[float, int, int]]:
        """(step seconds, tokens out, first tokens out) for every step of the requests to the end."""
        from mlaserve.sampling.params import SamplingParams

        engine = self.llm.engine
        for p in prompts:
            engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        steps, seen = [], {}  # (seconds, tokens out, requests that got their first token)
        while engine.has_unfinished():
            t0 = time.perf_counter()
            outs = engine.step()
            dt, new, first = time.perf_counter() - t0, 0, 0
            for o in outs:  # token_ids is the request's whole output so far
                first += seen.get(o.request_id, 0) == 0 and len(o.outputs[0].token_ids) > 0
                new += len(o.outputs[0].token_ids) - seen.get(o.request_id, 0)
                seen[o.request_id] = len(o.outputs[0].token_ids)
            steps.append((dt, new, first))
        return steps

    def prefill(self, ids: list[int]) -> float:
        return sum(t for t, _, _ in self._run([ids], 1))

    def start(self, ids: list[int], steps: int) -> tuple[float, int]:
        """Prefill one request that will decode `steps` more tokens; -> (seconds to its first token, that token)."""
        from mlaserve.sampling.params import SamplingParams

        engine = self.llm.engine
        self._rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
        total = 0.0
        while True:
            t0 = time.perf_counter()
            outs = engine.step()
            total += time.perf_counter() - t0
            firsts = [o.outputs[0].token_ids for o in outs if o.request_id == self._rid and o.outputs[0].token_ids]
            if firsts:
                return total, int(firsts[0][0])

    def steps(self, n: int) -> float:
        """Mean time of the next n steps of the started request (one decode token each)."""
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.llm.engine.step()
            ts.append(time.perf_counter() - t0)
        return statistics.mean(ts)

    def finish(self) -> None:
        self.llm.engine.abort(self._rid)
        while self.llm.engine.has_unfinished():
            self.llm.engine.step()

    def profile_decode(self, prompts: list[list[int]]) -> str:
        """cProfile of DECODE_STEPS decode steps with every request in the step (after their prefills): the
        step's time per function (cumulative), the engine's own functions first."""
        import cProfile
        import io
        import pstats

        from mlaserve.sampling.params import SamplingParams

        engine = self.llm.engine
        for p in prompts:
            engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 2, ignore_eos=True))
        done = 0
        while done < len(prompts):  # the prefills (each request's first token)
            done += sum(len(o.outputs[0].token_ids) == 1 for o in engine.step())
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(DECODE_STEPS):
            engine.step()
        prof.disable()
        wall = time.perf_counter() - t0
        while engine.has_unfinished():
            engine.step()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(r"mlaserve|torch/nn/functional", 40)
        return f"{self.name}: {DECODE_STEPS} decode steps of {len(prompts)} in {wall:.2f} s\n{out.getvalue()}"

    def decode(self, prompts: list[list[int]]) -> float:
        """Mean step time of the DECODE_STEPS steps after every request has its first token (with drafts
        accepted the requests finish in fewer steps: then the mean over the steps after the prefills)."""
        steps = self._run(prompts, DECODE_STEPS + 1)
        firsts, start = 0, 0
        while firsts < len(prompts):  # the prefill steps: until every request has its first token
            firsts += steps[start][2]
            start += 1
        timed = steps[start:]
        self.tokens_per_step.append(sum(n for _, n, _ in timed) / len(timed))
        return statistics.mean(t for t, _, _ in timed)


class Transformers:
    name = "transformers"

    def __init__(self, folder: Path, chunk: int = 1024) -> None:
        from transformers import DeepseekV4ForCausalLM

        self.model = DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.chunk = chunk

    @torch.no_grad()
    def start(self, ids: list[int], steps: int) -> tuple[float, int]:
        """Prefill in `chunk`-token forwards through the cache; -> (seconds, the first greedy token)."""
        t0 = time.perf_counter()
        past = None
        for i in range(0, len(ids), self.chunk):
            out = self.model(torch.tensor([ids[i : i + self.chunk]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
        self._past, self._next = past, out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - t0, int(self._next[0, 0])

    @torch.no_grad()
    def steps(self, n: int) -> float:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            out = self.model(self._next, past_key_values=self._past, use_cache=True)
            self._past, self._next = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            ts.append(time.perf_counter() - t0)
        return statistics.mean(ts)

    def finish(self) -> None:
        self._past = self._next = None

    @torch.no_grad()
    def prefill(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.model(torch.tensor([ids]), use_cache=True).logits[:, -1].argmax(-1)
        return time.perf_counter() - t0

    @torch.no_grad()
    def decode(self, prompts: list[list[int]]) -> float:
        out = self.model(torch.tensor(prompts), use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        ts = []
        for _ in range(DECODE_STEPS):
            t0 = time.perf_counter()
            out = self.model(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            ts.append(time.perf_counter() - t0)
        return statistics.mean(ts)


class LlamaCpp:
    """llama.cpp on the same model's Q8_0 GGUF (`mlaserve convert`), through llama-cpp-python's low-level C API
    (the scheme of benchmarks/offline_workers.py's LlamaCppWorker): one context per batch shape (n_seq_max = the
    requests, n_ctx = n_seq_max x the padded per-request length), prompts in n_batch-token llama_decode calls,
    then one token per sequence per call, greedy. Its own defaults otherwise (F16 K cache, flash attention
    auto), except `extra_bufts`: off by default, as its AMX repack of Q8_0 weights aborts this graph
    (GGML_ASSERT(*cur_backend_id != -1) in ggml_backend_sched) on an AMX CPU."""

    name = "llama.cpp"
    N_BATCH, N_UBATCH = 2048, 512  # llama.cpp's defaults

    def __init__(self, path: Path, threads: int, extra_bufts: bool = False) -> None:
        import llama_cpp as lc
        import numpy as np

        self.lc, self.np, self.threads = lc, np, threads
        self._keep_log = lc.llama_log_callback(self._log)
        lc.llama_log_set(self._keep_log, None)
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.use_extra_bufts = extra_bufts
        self.model = lc.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path} (its log above says why)")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.ctx, self.batch, self.ctx_params = None, None, None
        self.model_params = {"use_extra_bufts": bool(mp.use_extra_bufts), "use_mmap": getattr(mp, "use_mmap", None)}

    @staticmethod
    def _log(level, text, user_data) -> None:
        if level in (3, 4):  # GGML_LOG_LEVEL_WARN, _ERROR
            sys.stderr.write("[llama.cpp] " + text.decode(errors="replace"))

    def _context(self, n_seq: int, per_seq: int) -> None:
        lc = self.lc
        self.finish()
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_seq * (-(-per_seq // 256) * 256)
        cp.n_batch, cp.n_ubatch, cp.n_seq_max = self.N_BATCH, self.N_UBATCH, n_seq
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed (n_ctx {cp.n_ctx}, n_seq_max {n_seq})")
        self.batch = lc.llama_batch_init(self.N_BATCH, 0, 1)
        self.ctx_params = {"n_ctx": cp.n_ctx, "n_batch": cp.n_batch, "n_ubatch": cp.n_ubatch, "n_seq_max": n_seq}
        self.ctx_params |= {"flash_attn_type": cp.flash_attn_type, "type_k": cp.type_k, "type_v": cp.type_v}

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, pos, seq, wants logits), one llama_decode per n_batch items; -> the argmax token of
        every item that wants logits, in order."""
        lc, b, picks = self.lc, self.batch, []
        for start in range(0, len(items), self.N_BATCH):
            part = items[start : start + self.N_BATCH]
            for i, (tok, pos, seq, out) in enumerate(part):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(out)
                b.seq_id[i][0] = seq
            b.n_tokens = len(part)
            if (rc := lc.llama_decode(self.ctx, b)) != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            for i, item in enumerate(part):
                if item[3]:
                    row = self.np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                    picks.append(int(row.argmax()))
        return picks

    def _prompts(self, prompts: list[list[int]]) -> list[int]:
        return self._decode([(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)])

    def prefill(self, ids: list[int]) -> float:
        self._context(1, len(ids) + 1)
        t0 = time.perf_counter()
        self._prompts([ids])
        return time.perf_counter() - t0

    def start(self, ids: list[int], steps: int) -> tuple[float, int]:
        self._context(1, len(ids) + steps + 1)
        t0 = time.perf_counter()
        (self._next,) = self._prompts([ids])
        self._pos = len(ids)
        return time.perf_counter() - t0, self._next

    def steps(self, n: int) -> float:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            (self._next,) = self._decode([(self._next, self._pos, 0, True)])
            ts.append(time.perf_counter() - t0)
            self._pos += 1
        return statistics.mean(ts)

    def finish(self) -> None:
        if self.ctx is not None:
            self.lc.llama_free(self.ctx)
            self.lc.llama_batch_free(self.batch)
            self.ctx = self.batch = None

    def decode(self, prompts: list[list[int]]) -> float:
        n = len(prompts[0])
        self._context(len(prompts), n + DECODE_STEPS + 1)
        nxt, ts = self._prompts(prompts), []
        for step in range(DECODE_STEPS):
            t0 = time.perf_counter()
            nxt = self._decode([(t, n + step, s, True) for s, t in enumerate(nxt)])
            ts.append(time.perf_counter() - t0)
        return statistics.mean(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024])
    ap.add_argument("--engines", nargs="+", default=["mlaserve", "transformers"])
    ap.add_argument("--cases", nargs="+", default=None, help="a subset: prefill, decode, concurrent")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile each mlaserve engine's 16 concurrent decode")
    ap.add_argument("--hf-chunk", type=int, default=1024, help="transformers' prefill chunk for decode @N")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--weights", choices=["float", "fp8", "fp4"], default="float", help="fp8 / fp4: see above")
    ap.add_argument(
        "--llama-extra-bufts",
        action="store_true",
        help="llama.cpp: its extra (repacking) weight buffers on (off by default: AMX's aborts this graph)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    env = environment(args.threads)
    folder = ensure_v4_model(args.quick)
    if args.weights != "float":
        folder = ensure_v4_quantized(folder, args.weights)
    vocab = MODEL["vocab_size"]
    makers = {"mlaserve": Mlaserve, "mlaserve-per-seq": lambda f: Mlaserve(f, batched=False)}
    makers["mlaserve-per-seq-state"] = lambda f: Mlaserve(f, batched_state=False)
    makers["transformers"] = lambda f: Transformers(f, args.hf_chunk)
    makers["mlaserve-mtp"] = lambda f: Mlaserve(ensure_v4_mtp_model(f), mtp=True)
    makers["mlaserve-torch"] = lambda f: Mlaserve(f, kernels="torch")
    makers["mlaserve-loop"] = lambda f: Mlaserve(f, kernels="torch", expert_loop=True)
    files: dict[str, Path] = {}

    def q8_0(f: Path) -> Path:  # the same model's Q8_0 GGUF (`mlaserve convert`), written once beside the folder
        from model_files import ensure_gguf

        files.setdefault("q8_0", ensure_gguf(f, "q8_0"))
        return files["q8_0"]

    makers["mlaserve-gguf"] = lambda f: Mlaserve(q8_0(f), name="mlaserve-gguf")
    # the same file with Q8_0's products on int8 activations (llama.cpp's arithmetic; not exact): the kernels'
    # share of the gap to llama.cpp apart from the rest of the step
    makers["mlaserve-gguf-int8"] = lambda f: Mlaserve(q8_0(f), name="mlaserve-gguf-int8", activations="int8")
    makers["llama.cpp"] = lambda f: LlamaCpp(q8_0(f), args.threads, args.llama_extra_bufts)
    engines = [makers[e](folder) for e in args.engines]
    cases = {"prefill 512": ("prefill", random_prompt(512, vocab, 1))}
    cases["16 concurrent"] = ("decode", [random_prompt(128, vocab, 10 + i) for i in range(16)])
    contexts = args.contexts
    if args.cases:
        cases = {c: v for c, v in cases.items() if any(c.startswith(k) or k in c for k in args.cases)}
        contexts = contexts if "decode" in args.cases else []
    raw: dict[str, dict[str, list[float]]] = {c: {e.name: [] for e in engines} for c in cases}
    first_tokens: dict[str, dict[str, int]] = {}
    for n in contexts:  # one prefill per engine, then the reps' decode steps continue the same request
        prompt = random_prompt(n, vocab, 2)
        raw[f"prefill @{n}"] = {e.name: [] for e in engines}
        raw[f"decode @{n}"] = {e.name: [] for e in engines}
        first_tokens[f"decode @{n}"] = {}
        for eng in engines:
            t, tok = eng.start(prompt, DECODE_STEPS * args.reps)
            raw[f"prefill @{n}"][eng.name].append(t)
            first_tokens[f"decode @{n}"][eng.name] = tok
            print(f"prefill @{n} {eng.name:12s} {t:9.1f} s, first token {tok}", flush=True)
        for rep in range(args.reps):
            for eng in engines if rep % 2 == 0 else engines[::-1]:
                t = eng.steps(DECODE_STEPS)
                raw[f"decode @{n}"][eng.name].append(t)
                print(f"[rep {rep}] decode @{n} {eng.name:12s} {t * 1e3:9.1f} ms/step", flush=True)
        for eng in engines:
            eng.finish()
    profiles = {}
    if args.profile:  # before the timed reps (the profiler's own overhead stays out of them)
        concurrent = [random_prompt(128, vocab, 10 + i) for i in range(16)]
        for e in engines:
            if isinstance(e, Mlaserve):
                profiles[e.name] = e.profile_decode(concurrent)
                print(profiles[e.name], flush=True)
    for rep in range(args.reps):
        order = engines if rep % 2 == 0 else engines[::-1]  # alternate: neither engine always runs first
        for case, (what, arg) in cases.items():
            for eng in order:
                t = getattr(eng, what)(arg)
                raw[case][eng.name].append(t)
                print(f"[rep {rep}] {case:14s} {eng.name:12s} {t * 1e3:9.1f} ms", flush=True)
    results = {c: {e: _spread(ts) for e, ts in per.items()} for c, per in raw.items()}
    rows = []
    for case, per in results.items():
        batch = 16 if case == "16 concurrent" else 1
        row = [case]
        for e in engines:
            r = per[e.name]
            tokens = int(case.split()[-1].lstrip("@")) if case.startswith("prefill") else batch
            if case == "16 concurrent" and getattr(e, "tokens_per_step", None):  # drafts may add tokens
                tokens = statistics.median(e.tokens_per_step)
            row += [f"{fmt(r['median_s'] * 1e3)} ({fmt(r['min_s'] * 1e3)}-{fmt(r['max_s'] * 1e3)})"]
            row += [fmt(tokens / r["median_s"])]
        rows.append(row)
    headers = ["case"] + [h for e in engines for h in (f"{e.name} ms (min-max)", f"{e.name} tok/s")]
    print_table(headers, rows)
    cfg = MODEL if not args.quick else dict(MODEL, layer_types=[SW, CSA, HCA])
    kinds = {k: cfg["layer_types"].count(k) for k in (SW, CSA, HCA)}
    ours = kv_bytes_per_token(kinds, 512, 128, 128, 4, 128, 131072)
    flash = kv_bytes_per_token(FLASH["kinds"], 512, 128, 128, 4, 128, 131072)
    kv = {
        "this model": {"v4": ours[0], "v32": ours[1], "ratio": ours[1] / ours[0]},
        "V4-Flash (43 layers)": {"v4": flash[0], "v32": flash[1], "ratio": flash[1] / flash[0]},
    }
    print_table(
        ["KV bytes/token @128K (bf16)", "V4", "V3.2 layout", "V3.2 / V4"],
        [[k, fmt(v["v4"]), fmt(v["v32"]), f"{v['ratio']:.1f}x"] for k, v in kv.items()],
    )
    env["loadavg_end"] = list(os.getloadavg())
    print(f"load average start {env['loadavg_start']} end {env['loadavg_end']}; cpu {env['cpu']} {env['cpu_simd']}")
    out = args.out or RESULTS_DIR / f"deepseek_v4{'-quick' if args.quick else ''}.json"
    if first_tokens:
        print(f"first greedy token after each prompt: {first_tokens}")
    meta = {"decode_steps_per_rep": DECODE_STEPS, "reps": args.reps, "hf_prefill_chunk": args.hf_chunk}
    meta |= {"weights": args.weights, "kernel_plans": {e.name: getattr(e, "kernels", None) for e in engines}}
    if files:  # relative to the checkout: no machine paths in results
        root = Path(__file__).resolve().parent.parent
        meta["gguf"] = {k: os.path.relpath(v, root) for k, v in files.items()}
        meta["gguf_mib"] = {k: v.stat().st_size / 2**20 for k, v in files.items()}
    for e in engines:
        if isinstance(e, LlamaCpp):
            meta["llama.cpp"] = {
                "llama_cpp_python": getattr(e.lc, "__version__", None),
                "system_info": e.lc.llama_print_system_info().decode(errors="replace").strip(),
                "model_params": e.model_params,
                "context_params": e.ctx_params,
            }
    write_json(
        out,
        {
            "env": env,
            "settings": meta,
            "model": cfg,
            "results": results,
            "first_tokens": first_tokens,
            "tokens_per_step_16_concurrent": {e.name: getattr(e, "tokens_per_step", None) for e in engines},
            "kv_bytes_per_token_128k": kv,
            "profiles": profiles,
        },
    )


if __name__ == "__main__":
    main()
