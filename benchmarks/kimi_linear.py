"""Kimi-Linear: the decode step against the context and the batch, beside a same-width all-MLA stack and transformers.

    python benchmarks/kimi_linear.py [--threads 1] [--contexts 1024 16384 65536] [--batches 1 16] [--reps 3]
                                     [--max-gib 8] [--hf-prefill] [--no-transformers] [--no-prefill] [--tag T]
                                     [--quick]

The models (random weights, seed 0, written once by transformers' save_pretrained under benchmarks/models/):
Kimi-Linear-48B's per-layer widths (hidden 2304, 32 KDA heads x 128, conv 4; MLA 32 heads, kv_lora 512, nope 128,
"rope" 64, v 128, q_proj without LoRA) with 4 layers in its 3:1 pattern (KDA, KDA, KDA, MLA), and the same stack
with every layer MLA. Both small where the point is not: 4 routed experts (top 2) of 1024, a first dense layer of
4096, a 4096-token vocabulary. float32 throughout; prefix caching off (its page-boundary snapshots of the KDA
states, 2 MiB per page and KDA layer here, are not what is measured: their bytes per token are reported).

Phases (engines alternated rep by rep inside each, so load drift hits them alike):
1. prefill: one 4096-token prompt through the engine, chunked as it does (its default 2048-token step budget),
   tokens/s (transformers' one forward over it with --hf-prefill: its reference chunk_kda takes minutes here).
2. check at 1K, batch 1: a request prefilled for real (transformers too: its 1K prefill is timed), then its
   decode step (ours: runner.execute, forward + logits, no scheduling or sampling) alternated with the same step
   on a synthetic fill (below). The scale of the synthetic KDA states is taken from that real prefill's states,
   per layer. Also: ours and transformers decode one token from the *same* synthetic state (transformers' cache
   filled from ours): the max abs diff of their logits says the fill is one state both engines read alike.
3. decode at each context N and batch B on synthetic caches: a step's cost does not depend on the values, and a
   64K prefill takes hours here, so no context is prefilled. Ours: B requests hold pages from the engine's pool
   and a slot from its slot pool; every MLA layer's latent rows [RMSNorm'd c_kv * norm weight | k ~ N(0,1)]
   (common.synthetic_latent_rows) are written at their slots for positions [0, N), each KDA layer's recurrent
   [H, d, d] and conv [K-1, 3 H d] states get N(0, s^2) values, s that layer's measured standard deviation.
   Transformers: its DynamicCache (KDA layers: LinearAttentionLayer's conv [B, 3 H d, K] and recurrent
   [B, H, d, d]; MLA layers: the latent kv [B, 1, N, 512] and k_rot [B, 1, N, 64] it caches) holds the same
   values, copied from ours. Transformers expands every cached latent through kv_b_proj at every step
   ([B, N, H, 256] plus the [B, H, N, 192] keys, fp32), so a configuration whose cache + that expansion (ours: its
   cache) needs more than --max-gib, or would leave under HEADROOM_GIB of the machine's available memory, is not
   run: the bytes it needs are reported instead.
4. resident state per request from the engine's accounting: the cache's measured state bytes per slot plus the
   pool's pages a request at context N holds times the cache's measured bytes per token of a page; transformers'
   cache objects' tensors per request where it ran.
Results: a table on stdout and benchmarks/results/kimi_linear[-quick].json (the load average with every phase).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    MODELS_DIR,
    RESULTS_DIR,
    environment,
    mem_available_gib,
    random_prompt,
    slots_for,
    synthetic_latent_rows,
    write_json,
)

K, M = "linear_attention", "full_attention"
SHAPE = dict(
    vocab_size=4096,
    hidden_size=2304,
    intermediate_size=4096,
    moe_intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=32,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    num_local_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    linear_num_heads=32,
    linear_head_dim=128,
    pad_token_id=2,
    bos_token_id=0,
    eos_token_id=1,
)
# --quick: the same layout at toy widths (a smoke run in seconds); rms_norm_eps 1e-3 as the model tests use, so
# the fp32 agreement with transformers is not dominated by a near-zero head's amplified rounding
QUICK_SHAPE = SHAPE | dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=3,
    num_key_value_heads=3,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    linear_num_heads=5,
    linear_head_dim=16,
    rms_norm_eps=1e-3,
)
STACKS = {"kimi_linear": [K, K, K, M], "all_mla": [M, M, M, M]}
FULL = dict(contexts=[1024, 16384, 65536], batches=[1, 16], prefill=4096, budget=2048, check=1024)
QUICK = dict(contexts=[64, 200], batches=[1, 3], prefill=96, budget=32, check=64)
PAGE = 16
SLOW_S = 15.0  # a step slower than this (its warm-up) is timed once
HEADROOM_GIB = 3.0  # a configuration that would leave less available memory than this is not run (shared machine)


def folder(name: str, quick: bool):
    path = MODELS_DIR / (f"kimi-linear-{name}" + ("-quick" if quick else ""))
    if not (path / "config.json").exists():
        from transformers import KimiLinearConfig, KimiLinearForCausalLM

        torch.manual_seed(0)
        shape = QUICK_SHAPE if quick else SHAPE
        KimiLinearForCausalLM(KimiLinearConfig(**shape, layer_types=STACKS[name])).save_pretrained(path)
    return path


# -- our engine ----------------------------------------------------------------------------------------------
class Ours:
    """One stack in the engine, with up to `max_batch` synthetic requests (pages from the pool, slots from the slot
    pool) of up to n_max tokens each; their rows are written as the contexts grow."""

    def __init__(self, path, threads: int, n_max: int, max_batch: int, budget: int) -> None:
        from mlaserve.entrypoints.llm import LLM

        self.pages_per_req = math.ceil((n_max + 1) / PAGE)
        self.llm = LLM(
            str(path),
            dtype="float32",
            threads=threads,
            page_size=PAGE,
            max_num_seqs=max_batch + 1,  # + the real request of the prefill and the check
            num_pages=(max_batch + 1) * self.pages_per_req + 1,
            max_num_batched_tokens=budget,
            enable_prefix_caching=False,
        )
        self.engine, self.runner, self.cache = self.llm.engine, self.llm.runner, self.llm.runner.cache
        self.kda = [i for i, k in enumerate(self.runner.layer_kinds) if k.attention == "kda"]
        self.reqs: list[tuple[list[int], int | None]] = []  # (pages, state slot) per synthetic request
        self.filled: list[int] = []  # rows written per synthetic request
        self.scales: dict[int, dict[str, float]] = {}

    def prefill(self, prompt: list[int], rid: str) -> float:
        """A real prefill through engine.step (chunked by the step budget) -> seconds; the request stays running."""
        from mlaserve.sampling.params import SamplingParams

        self.engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), rid)
        t = time.perf_counter()
        while not any(r.request_id == rid and r.num_computed >= len(prompt) for r in self.engine.scheduler.running):
            self.engine.step()
        return time.perf_counter() - t

    def request(self, rid: str):
        return next(r for r in self.engine.scheduler.running if r.request_id == rid)

    def measure_scales(self, rid: str) -> None:
        """Per KDA layer, the standard deviation of the states a real prefill left in this request's slot."""
        slot = self.request(rid).state_slot
        for i in self.kda:
            t = self.cache.layers[i].tensors
            self.scales[i] = {name: float(t[name][slot].float().std()) for name in ("recurrent", "conv")}

    def finish(self, rid: str) -> None:
        self.engine.abort(rid)
        while self.engine.has_unfinished():
            self.engine.step()

    def grow(self, batch: int, n: int, seed: int) -> None:
        """Synthetic requests 0..batch-1 with rows for positions [0, n) and random KDA states."""
        g = torch.Generator().manual_seed(seed)
        while len(self.reqs) < batch:
            rid = f"syn-{len(self.reqs)}"
            pages = self.engine.pool.allocate(self.pages_per_req)
            slot = self.engine.slots.allocate(rid) if self.engine.slots else None
            self.reqs.append((pages, slot))
            self.filled.append(0)
            self._fill_states(slot, g)
        with torch.inference_mode():
            for r in range(batch):
                pages, _ = self.reqs[r]
                a = self.filled[r]
                if a >= n:
                    continue
                slots = slots_for(pages, n, PAGE)[a:n]
                for i, layer in enumerate(self.runner.model.model.layers):
                    if i in self.kda:
                        continue
                    latent = self.cache.layers[i].latent
                    latent.index_copy_(0, slots, synthetic_latent_rows(n - a, layer.self_attn, latent.dtype, g))
                self.filled[r] = n

    def _fill_states(self, slot: int | None, g: torch.Generator) -> None:
        for i in self.kda:
            for name, s in self.scales[i].items():
                t = self.cache.layers[i].tensors[name]
                t[slot] = (torch.randn(t.shape[1:], generator=g) * s).to(t.dtype)

    def chunks(self, batch: int, n: int, seqs=None):
        """One decode token per request at context n (the token's row n is rewritten by every rep)."""
        from mlaserve.executor.forward_batch import SeqChunk

        used = math.ceil((n + 1) / PAGE)
        seqs = seqs or [(f"syn-{r}", *self.reqs[r]) for r in range(batch)]
        return [SeqChunk(rid, (5,), n, tuple(pages[:used]), state_slot=slot) for rid, pages, slot in seqs]

    def step(self, chunks) -> torch.Tensor:
        return self.runner.execute(chunks)[1]

    def resident(self, n: int) -> dict:
        """Bytes one request at context n holds, from the cache's measured allocation and the pool's pages."""
        state = self.cache.measured_bytes_per_request()
        per_token = self.cache.measured_bytes_per_token()
        pages = math.ceil(n / PAGE)
        return dict(
            state_bytes=state,
            row_bytes_per_token=per_token,
            pages=pages,
            rows_bytes=pages * PAGE * per_token,
            total_bytes=state + pages * PAGE * per_token,
        )


# -- transformers --------------------------------------------------------------------------------------------
class Theirs:
    def __init__(self, path) -> None:
        from transformers import KimiLinearForCausalLM

        self.model = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.cfg = self.model.config

    def expansion_bytes(self, batch: int, n: int) -> int:
        """What one MLA layer's step materialises over the context (fp32): kv_b_proj's [B, N, H, nope + v] output,
        the [B, H, N, nope + rope] keys, and a contiguous copy of the values the attention may take."""
        c = self.cfg
        width = c.qk_nope_head_dim + c.v_head_dim + c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim
        return batch * n * c.num_attention_heads * width * 4

    def cache_bytes(self, batch: int, n: int) -> int:
        c = self.cfg
        mla = sum(t == M for t in c.layer_types) * batch * n * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
        w = c.linear_num_heads * c.linear_head_dim
        kda = sum(t == K for t in c.layer_types) * batch * (c.linear_num_heads * c.linear_head_dim**2 + 3 * w * 4) * 4
        return mla + kda

    def need_bytes(self, batch: int, n: int) -> int:
        """The cache, its copy while DynamicLayer.update concatenates the new token, one layer's expansion."""
        return 2 * self.cache_bytes(batch, n) + self.expansion_bytes(batch, n)

    def prefill(self, prompt: list[int]) -> float:
        t = time.perf_counter()
        self.real_cache(prompt)
        return time.perf_counter() - t

    def real_cache(self, prompt: list[int]):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.cfg)
        with torch.inference_mode():
            self.model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
        return cache

    def cache_from(self, ours: Ours, batch: int, n: int):
        """A DynamicCache holding what ours holds for synthetic requests 0..batch-1 at context n."""
        from transformers import DynamicCache

        c, cache = self.cfg, DynamicCache(config=self.cfg)
        r = c.kv_lora_rank
        for i, kind in enumerate(c.layer_types):
            t = ours.cache.layers[i].tensors
            if kind == M:
                rows = torch.stack([t["latent"].index_select(0, slots_for(p, n, PAGE)) for p, _ in ours.reqs[:batch]])
                cache.layers[i].update(rows[:, None, :, :r].contiguous(), rows[:, None, :, r:].contiguous())
            else:
                slots = torch.tensor([s for _, s in ours.reqs[:batch]])
                conv = t["conv"].index_select(0, slots).transpose(1, 2)  # [B, 3 H d, K - 1]
                # transformers keeps K columns; its decode convolves the last K - 1 and the new input
                conv = torch.cat([torch.zeros_like(conv[..., :1]), conv], dim=-1)
                layer = cache.layers[i]
                rec = t["recurrent"].index_select(0, slots).float()
                layer.lazy_initialization(conv_states=conv, recurrent_states=rec, conv_kernel_size=conv.shape[-1])
                layer.conv_states[0].copy_(conv)
                layer.recurrent_states[0].copy_(rec)
                layer.has_previous_state[0] = True
        return cache

    def step(self, cache, batch: int) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model(input_ids=torch.full((batch, 1), 5), cache=cache, use_cache=True)
        return out.logits[:, -1].float()

    @staticmethod
    def bytes_per_request(cache, batch: int) -> int:
        total = 0
        for layer in cache.layers:
            for name in ("keys", "values"):
                x = getattr(layer, name, None)
                total += x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0
            for d in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
                total += sum(x.numel() * x.element_size() for x in d.values() if x is not None)
        return total // batch


def vocab(ours: dict) -> int:
    return next(iter(ours.values())).runner.model.model.embed_tokens.weight.shape[0]


# -- phases --------------------------------------------------------------------------------------------------
def alternate(fns: dict, reps: int, slow_s: float = SLOW_S) -> dict:
    """Each fn timed `reps` times after one warm-up call, the fns alternated rep by rep -> per name: median and all
    times (s). A fn whose warm-up took over slow_s is timed once (transformers' long contexts: its step expands
    every cached latent; such a step is many times the gaps being measured)."""
    warm = {}
    for k, fn in fns.items():
        t = time.perf_counter()
        fn()
        warm[k] = time.perf_counter() - t
    ts = {k: [] for k in fns}
    for rep in range(reps):
        for k, fn in fns.items():
            if rep and warm[k] > slow_s:
                continue
            t = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t)
    return {k: dict(median_s=statistics.median(v), all_s=v, warmup_s=warm[k]) for k, v in ts.items()}


def phase_prefill(ours: dict, theirs: dict, n: int, reps: int, with_transformers: bool) -> dict:
    prompt = random_prompt(n, vocab(ours), seed=1)
    out = {}
    for rep in range(reps):
        for name, o in ours.items():
            s = o.prefill(prompt, f"prefill-{rep}")
            o.finish(f"prefill-{rep}")
            out.setdefault(f"ours/{name}", []).append(n / s)
        for name, h in theirs.items() if with_transformers else ():
            out.setdefault(f"transformers/{name}", []).append(n / h.prefill(prompt))
        print(f"prefill {n}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in out.items()), flush=True)
    return {k: dict(tok_s=statistics.median(v), all_tok_s=v, load=os.getloadavg()) for k, v in out.items()}


def phase_check(ours: dict, theirs: dict, n: int, reps: int) -> dict:
    """At context n, batch 1: the decode step after a real prefill against the step on a synthetic fill (both
    engines), and ours vs transformers from the same synthetic state."""
    out = {}
    prompt = random_prompt(n, vocab(ours), seed=2)
    for name, o in ours.items():
        res = {f"ours_prefill_{n}_tok_s": n / o.prefill(prompt, "real")}
        o.measure_scales("real")
        o.grow(1, n, seed=3)
        req = o.request("real")
        missing = math.ceil((n + 1) / PAGE) - len(req.pages)  # the decode token's page, if the prompt filled its last
        req.pages.extend(o.engine.pool.allocate(missing) if missing > 0 else [])  # freed with the request
        real = o.chunks(1, n, [("real", req.pages, req.state_slot)])
        syn = o.chunks(1, n)
        fns = {"real": lambda real=real, o=o: o.step(real), "synthetic": lambda syn=syn, o=o: o.step(syn)}
        h = theirs.get(name)
        if h is not None:
            t0 = time.perf_counter()
            hf_real = h.real_cache(prompt)
            res[f"transformers_prefill_{n}_tok_s"] = n / (time.perf_counter() - t0)
            res["same_state_logits_max_abs_diff"] = agreement(o, h, n)
            hf_syn = h.cache_from(o, 1, n)
            fns |= {
                "transformers_real": lambda c=hf_real, h=h: h.step(c, 1),
                "transformers_synthetic": lambda c=hf_syn, h=h: h.step(c, 1),
            }
        load = os.getloadavg()
        t = alternate(fns, reps)
        o.finish("real")
        out[name] = res | {f"{k}_ms": v["median_s"] * 1e3 for k, v in t.items()}
        out[name] |= {"all_s": t, "scales": o.scales, "load_before": load, "load_after": os.getloadavg()}
        ms = ", ".join(f"{k} {v['median_s'] * 1e3:.1f} ms" for k, v in t.items())
        diff = res.get("same_state_logits_max_abs_diff")
        print(f"check {name} at {n}, batch 1: {ms}" + (f"; ours vs transformers {diff:.2e}" if h else ""), flush=True)
    return out


def agreement(o: Ours, h: Theirs, n: int) -> float:
    """One decode token from the same synthetic state in both engines -> max abs diff of the logits. Our request's
    KDA states are put back after (the step advances them) so the timing that follows starts from the fill."""
    slot = o.reqs[0][1]
    saved = {i: {k: v[slot].clone() for k, v in o.cache.layers[i].tensors.items() if k != "latent"} for i in o.kda}
    ref = h.step(h.cache_from(o, 1, n), 1)
    got = o.step(o.chunks(1, n))
    for i, states in saved.items():
        for k, v in states.items():
            o.cache.layers[i].tensors[k][slot] = v
    return float((got - ref).abs().max())


def fits(need: float) -> bool:
    """Whether `need` more bytes leave HEADROOM_GIB of the machine's available memory (it is shared)."""
    return need < (mem_available_gib() - HEADROOM_GIB) * 2**30


def skip_reason(need: float, max_bytes: float) -> dict:
    why = f"over --max-gib {max_bytes / 2**30:g}" if need > max_bytes else f"{mem_available_gib():.1f} GiB available"
    return dict(need_gib=need / 2**30, why=why)


def phase_decode(ours: dict, theirs: dict, contexts, batches, reps: int, max_bytes: float, save) -> list[dict]:
    """save(runs): called after every configuration, so a run killed later (memory) keeps what it measured."""
    runs = []
    for n in contexts:
        for b in batches:
            fns, skipped = {}, {}
            for name, o in ours.items():
                # the rows not written yet (the cache's memory becomes resident as rows are first written)
                need = sum(max(0, n - f) for f in o.filled[:b]) + max(0, b - len(o.filled)) * n
                need = need * o.cache.measured_bytes_per_token()
                total = b * n * o.cache.measured_bytes_per_token()
                if total > max_bytes or not fits(need):
                    skipped[f"ours/{name}"] = skip_reason(total, max_bytes)
                    continue
                o.grow(b, n, seed=100 + n + b)
                chunks = o.chunks(b, n)
                fns[f"ours/{name}"] = lambda o=o, c=chunks: o.step(c)
            caches = {}
            for name, h in theirs.items():
                need = h.need_bytes(b, n)
                if need > max_bytes or not fits(need) or f"ours/{name}" not in fns:  # filled from ours
                    skipped[f"transformers/{name}"] = skip_reason(need, max_bytes)
                    continue
                caches[name] = h.cache_from(ours[name], b, n)
                fns[f"transformers/{name}"] = lambda h=h, c=caches[name], b=b: h.step(c, b)
            load = os.getloadavg()
            t = alternate(fns, reps) if fns else {}
            run = dict(context=n, batch=b, load_before=load, load_after=os.getloadavg(), skipped=skipped)
            run["mem_available_gib"] = mem_available_gib()
            run |= {k: dict(step_ms=v["median_s"] * 1e3, all_ms=[x * 1e3 for x in v["all_s"]]) for k, v in t.items()}
            for name, c in caches.items():
                run[f"transformers/{name}"]["cache_bytes_per_request"] = Theirs.bytes_per_request(c, b)
            caches.clear()
            runs.append(run)
            save(runs)
            ms = ", ".join(f"{k} {v['median_s'] * 1e3:.1f} ms" for k, v in t.items())
            skip = ", ".join(f"{k} not run (needs {v['need_gib']:.1f} GiB: {v['why']})" for k, v in skipped.items())
            print(f"decode context {n}, batch {b}: {ms}" + (f"; {skip}" if skip else ""), flush=True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--contexts", type=int, nargs="+")
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill-reps", type=int, default=1)
    ap.add_argument("--max-gib", type=float, default=8.0, help="skip a configuration whose cache needs more")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-prefill", action="store_true", help="skip the 4K prefill (phase 1)")
    ap.add_argument(
        "--hf-prefill",
        action="store_true",
        help="also time transformers' prefill of the 4K prompt (its reference chunk_kda takes minutes here)",
    )
    ap.add_argument("--tag", default="", help="suffix of the JSON's name (a partial run beside the full one)")
    ap.add_argument("--quick", action="store_true", help="toy widths, short contexts: a smoke run in seconds")
    args = ap.parse_args()
    plan = QUICK if args.quick else FULL
    contexts, batches = args.contexts or plan["contexts"], args.batches or plan["batches"]
    env = environment(args.threads)
    torch.set_num_threads(args.threads)
    from mlaserve.cache.model_cache import ModelCache
    from mlaserve.config.layer_kinds import describe

    n_max = max(*contexts, plan["prefill"], plan["check"])
    ours = {name: Ours(folder(name, args.quick), args.threads, n_max, max(batches), plan["budget"]) for name in STACKS}
    theirs = {} if args.no_transformers else {name: Theirs(folder(name, args.quick)) for name in STACKS}
    out = dict(
        environment=env,
        shape=QUICK_SHAPE if args.quick else SHAPE,
        stacks=STACKS,
        method="decode on synthetic caches (no prefill of the context); see the script's docstring",
        mem_available_gib=mem_available_gib(),
        max_gib=args.max_gib,
    )
    for name, o in ours.items():
        kinds = o.runner.layer_kinds
        out[f"{name}_layer_kinds"] = describe(kinds, 4, PAGE)
        out[f"{name}_snapshot_bytes_per_token"] = ModelCache.snapshot_bytes_per_token(kinds, torch.float32, PAGE)
        print(name, *out[f"{name}_layer_kinds"], sep="\n  ")
    print("decode steps run on synthetic caches (rows and KDA states written directly; nothing prefilled)")
    if not args.no_prefill:
        out["prefill"] = phase_prefill(ours, theirs, plan["prefill"], args.prefill_reps, args.quick or args.hf_prefill)
    out["check"] = phase_check(ours, theirs, plan["check"], args.reps)
    path = RESULTS_DIR / f"kimi_linear{'-quick' if args.quick else ''}{args.tag}.json"
    write_json(path, out)
    out["decode"] = phase_decode(
        ours,
        theirs,
        contexts,
        batches,
        args.reps,
        args.max_gib * 2**30,
        lambda runs: write_json(path, out | {"decode": runs}),
    )
    out["resident"] = {name: {n: o.resident(n) for n in contexts} for name, o in ours.items()}
    for name in ours:
        for n, r in out["resident"][name].items():
            print(
                f"resident {name} at {n}: {r['state_bytes'] / 2**20:.2f} MiB state + {r['rows_bytes'] / 2**20:.1f} "
                f"MiB rows = {r['total_bytes'] / 2**20:.1f} MiB per request",
                flush=True,
            )
    out["load_after"] = os.getloadavg()
    write_json(path, out)


if __name__ == "__main__":
    main()
