"""LongCat-Flash's zero-computation identity experts: decode with them vs the same model with them forced real.

A LongCat-shaped model scaled down (two MLA sublayers and two dense MLPs per layer, a shortcut MoE of 32 real
+ 16 identity experts, top-6, like the release's 512 + 256, top-12), random weights made here with transformers.
"forced real" is the same folder with the identity experts replaced by real experts of random weights
(n_routed_experts 48, zero_expert_num 0): the router's weights and bias are the same, so a token with the same
hidden state chooses the same experts with the same weights; the identity experts' pairs now run an FFN (the
generated tokens then differ, so the identity share is counted in each run). The difference is
the saving the identity experts buy. Reported: the share of (token, expert) pairs routed to identity experts
during the run, batch-1 decode tok/s (--new tokens after a 16-token prompt), the generated tok/s of --conc
concurrent requests (best of --reps), and the first layer's MoE op alone on 1 and 16 tokens (median of 200
calls: the saving without the attention and dense MLPs around it). One JSON per run under benchmarks/results/.

  python benchmarks/longcat_flash.py --quick    # a smoke test, not a benchmark
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, environment, print_table, write_json  # noqa: E402

from mlaserve import LLM, SamplingParams  # noqa: E402

SHAPE = dict(  # LongCat-Flash's proportions, scaled down (release: hidden 6144, 64 heads, 28 layers)
    hidden_size=1024,
    num_layers=2,
    num_attention_heads=8,
    ffn_hidden_size=1024,
    q_lora_rank=256,  # sqrt(1024 / 256) = 2: folded into q_b_proj, as the release's sqrt(6144 / 1536)
    kv_lora_rank=128,  # sqrt(8): applied after kv_a_layernorm, as the release's sqrt(12)
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    head_dim=32,
    v_head_dim=64,
    n_routed_experts=32,
    zero_expert_num=16,
    moe_topk=8,
    expert_ffn_hidden_size=256,  # top-8 x 256 = 2 x ffn_hidden_size, as the release's 12 x 2048 = 2 x 12288
    routed_scaling_factor=6.0,
    vocab_size=4096,
    max_position_embeddings=4096,
    bos_token_id=0,
    eos_token_id=1,
)
QUICK = dict(hidden_size=512, num_layers=1, ffn_hidden_size=512, q_lora_rank=128, kv_lora_rank=64)
# + on the identity experts' routing bias: the release's tokens pick ~1/3 identity experts (its 18.6B-31.3B
# active of 560B); random router weights alone give ~1/5, this bias brings the share near the release's
IDENTITY_BIAS = 0.004


def make_folders(root: Path, shape: dict) -> tuple[Path, Path]:
    from hf_models import reinit_
    from transformers import AutoConfig, AutoModelForCausalLM

    ident, real = root / "identity", root / "forced_real"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("longcat_flash", **shape), dtype=torch.float32)
    reinit_(model, 0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.e_score_correction_bias.zero_()[shape["n_routed_experts"] :] = IDENTITY_BIAS
    model.save_pretrained(ident)
    e, z, d, i = (
        shape["n_routed_experts"],
        shape["zero_expert_num"],
        shape["hidden_size"],
        shape["expert_ffn_hidden_size"],
    )
    g = torch.Generator().manual_seed(1)
    tensors = load_file(str(ident / "model.safetensors"))
    for layer in range(shape["num_layers"]):
        for x in range(e, e + z):  # the identity experts as real ones (transformers' save wrote unused gate/up)
            stem = f"model.layers.{layer}.mlp.experts.{x}"
            tensors[f"{stem}.gate_proj.weight"] = torch.randn(i, d, generator=g) * d**-0.5
            tensors[f"{stem}.up_proj.weight"] = torch.randn(i, d, generator=g) * d**-0.5
            tensors[f"{stem}.down_proj.weight"] = torch.randn(d, i, generator=g) * i**-0.5
    real.mkdir()
    save_file(tensors, str(real / "model.safetensors"))
    raw = json.loads((ident / "config.json").read_text())
    (real / "config.json").write_text(json.dumps({**raw, "n_routed_experts": e + z, "zero_expert_num": 0}))
    return ident, real


def identity_share(llm: LLM, n_real: int) -> tuple[list, callable]:
    """Counts (pairs, identity pairs) over the routers' calls until the returned remover is called."""
    counts = [0, 0]

    def hook(module, inp, out):
        idx = out[1]
        counts[0] += idx.numel()
        counts[1] += int((idx >= n_real).sum())

    hooks = [layer.mlp.router.register_forward_hook(hook) for layer in llm.loaded.model.model.layers]
    return counts, lambda: [h.remove() for h in hooks]


def moe_calls(llms: dict[str, LLM], d: int, rounds: int) -> dict[str, dict]:
    """Each variant's first-layer shortcut MoE alone (router + experts) on 1 and 16 tokens, the variants
    interleaved call by call (a shared machine's load drifts): median us per call. The same router in both,
    so the same pairs; only the identity pairs' work differs."""
    mods = {name: llm.loaded.model.model.layers[0].mlp for name, llm in llms.items()}
    g = torch.Generator().manual_seed(2)
    out: dict[str, dict] = {name: {} for name in llms}
    with torch.no_grad():
        for t in (1, 16):
            x = torch.randn(t, d, generator=g)
            times: dict[str, list[float]] = {name: [] for name in llms}
            for _ in range(rounds):
                for name, moe in mods.items():
                    t0 = time.perf_counter()
                    moe(x)
                    times[name].append(time.perf_counter() - t0)
            for name, ts in times.items():
                out[name][f"moe_t{t}_us"] = statistics.median(ts) * 1e6
    return out


def decode_rates(llms: dict[str, LLM], vocab: int, new: int, conc: int, reps: int) -> dict[str, dict]:
    """Batch-1 decode tok/s and the generated tok/s of `conc` concurrent requests, best of `reps`, the variants
    interleaved rep by rep."""
    g = torch.Generator().manual_seed(0)
    prompts = [[0] + torch.randint(3, vocab, (15,), generator=g).tolist() for _ in range(conc)]
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    out = {name: {"b1_all": [], "conc_all": []} for name in llms}
    for llm in llms.values():
        llm.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm up
    for _ in range(reps):
        for name, llm in llms.items():
            t = time.perf_counter()
            llm.generate([prompts[0]], sp)
            out[name]["b1_all"].append(new / (time.perf_counter() - t))
            t = time.perf_counter()
            outs = llm.generate(prompts, sp)
            out[name]["conc_all"].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    for r in out.values():
        r["b1_tok_s"], r["conc_tok_s"] = max(r["b1_all"]), max(r["conc_all"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--conc", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3, help="best of N (the machine may be shared)")
    ap.add_argument("--threads", type=int, default=1, help="1 on a shared machine: steadier figures")
    args = ap.parse_args()
    shape = {**SHAPE, **(QUICK if args.quick else {})}
    new, reps = (8, 1) if args.quick else (args.new, args.reps)
    env = environment(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folders = make_folders(Path(tmp), shape)
        llms = {
            name: LLM(str(folder), threads=args.threads, dtype="float32")
            for name, folder in zip(("identity experts", "forced real"), folders)
        }
        counters = {name: identity_share(llm, shape["n_routed_experts"]) for name, llm in llms.items()}
        results = decode_rates(llms, shape["vocab_size"], new, args.conc, reps)
        for name, (counts, stop) in counters.items():
            stop()
            results[name]["identity_pair_share"] = counts[1] / counts[0]
        for name, r in moe_calls(llms, shape["hidden_size"], 20 if args.quick else 200).items():
            results[name] |= r
    rows = [
        [name, f"{r['identity_pair_share']:.3f}", f"{r['b1_tok_s']:.1f}", f"{r['conc_tok_s']:.1f}"]
        + [f"{r['moe_t1_us']:.0f}", f"{r['moe_t16_us']:.0f}"]
        for name, r in results.items()
    ]
    headers = [
        "variant",
        "identity pair share",
        "decode b1 tok/s",
        f"c{args.conc} tok/s",
        "MoE 1 tok us",
        "MoE 16 tok us",
    ]
    table = print_table(headers, rows)
    keys = ("b1_tok_s", "conc_tok_s", "moe_t1_us", "moe_t16_us")
    ratio = [results["identity experts"][k] / results["forced real"][k] for k in keys]
    print(
        f"identity / forced real: decode b1 {ratio[0]:.2f}x, c{args.conc} {ratio[1]:.2f}x; "
        f"MoE op time 1 token {ratio[2]:.2f}x, 16 tokens {ratio[3]:.2f}x"
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    write_json(
        RESULTS_DIR / f"longcat_flash-{stamp}.json",
        {"env": env, "shape": shape, "args": vars(args), "results": results, "table": table, "speedup": ratio},
    )


if __name__ == "__main__":
    main()
