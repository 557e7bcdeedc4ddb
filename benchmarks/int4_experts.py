"""INT4 routed experts (compressed-tensors W4A16 pack-quantized, Kimi-K2.x) vs float vs Q4_0 at load,
on a Kimi-K2-shaped few-layer model (scaled down: one expert group, top-8, sigmoid router, first layer
dense), random weights made here with transformers.

Per variant: resident bytes of the routed experts, batch-1 decode tokens/s (--new tokens) and the
generated tokens/s of --conc concurrent requests. Variants: int4 experts with the native INT4 kernel and with
the torch reference (unpack the routed experts, then the grouped GEMM), both fp32 compute; fp32 and bf16 float
folders; quantization="int4" (the same weights as Q4_0 blocks at load, native kernels: what a Q4_0 GGUF runs).

  python benchmarks/int4_experts.py --quick    # a smoke test, not a benchmark
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from mlaserve import LLM, SamplingParams  # noqa: E402
from mlaserve.quant import int4_group  # noqa: E402

SHAPE = dict(  # Kimi-K2's proportions, scaled down (K2: hidden 7168, 64 heads, 384 experts, moe 2048)
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=384,
    kv_lora_rank=128,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    n_routed_experts=48,
    num_experts_per_tok=8,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.827,
    vocab_size=4096,
    num_nextn_predict_layers=0,
    max_position_embeddings=4096,
)
QCONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True},
            "format": "pack-quantized",
        }
    },
    "ignore": ["lm_head"],
}


def make_folders(root: Path, layers: int) -> tuple[Path, Path]:
    from hf_models import reinit_
    from transformers import AutoConfig, AutoModelForCausalLM

    float_dir, int4_dir = root / "float", root / "int4"
    cfg = AutoConfig.for_model("deepseek_v3", **{**SHAPE, "num_hidden_layers": layers})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    reinit_(model, 0)
    model.save_pretrained(float_dir)
    tensors = load_file(str(float_dir / "model.safetensors"))
    packed = {}
    for name, t in tensors.items():
        if ".mlp.experts." in name and name.endswith(".weight"):
            p, s = int4_group.quantize(t)
            stem = name.removesuffix(".weight")
            packed |= {
                f"{stem}.weight_packed": p,
                f"{stem}.weight_scale": s,
                f"{stem}.weight_shape": torch.tensor(t.shape),
            }
        else:
            packed[name] = t
    int4_dir.mkdir()
    save_file(packed, str(int4_dir / "model.safetensors"))
    raw = json.loads((float_dir / "config.json").read_text())
    (int4_dir / "config.json").write_text(json.dumps({**raw, "quantization_config": QCONFIG}))
    return float_dir, int4_dir


def expert_bytes(llm: LLM) -> int:
    return sum(
        t.numel() * t.element_size()
        for name, module in llm.loaded.model.named_modules()
        if name.endswith("mlp.experts")
        for t in list(module.parameters()) + list(module.buffers())
    )


def measure(llm: LLM, new: int, conc: int, repeat: int = 1) -> tuple[float, float]:
    """Best of `repeat` runs of each (on a shared machine the best run is the one least slowed by others)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (16,), generator=g).tolist() for _ in range(conc)]
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm up
    b1 = cN = 0.0
    for _ in range(repeat):
        t = time.perf_counter()
        llm.generate([prompts[0]], sp)
        b1 = max(b1, new / (time.perf_counter() - t))
        t = time.perf_counter()
        outs = llm.generate(prompts, sp)
        cN = max(cN, sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    return b1, cN


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--conc", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="1 on a shared machine: steadier figures")
    ap.add_argument("--repeat", type=int, default=1, help="best of this many runs per figure")
    args = ap.parse_args()
    layers, new = (2, 8) if args.quick else (SHAPE["num_hidden_layers"], args.new)
    with tempfile.TemporaryDirectory() as tmp:
        float_dir, int4_dir = make_folders(Path(tmp), layers)
        variants = [
            ("int4 native / fp32", int4_dir, dict(dtype="float32", kernels="native")),
            ("int4 torch ref / fp32", int4_dir, dict(dtype="float32", kernels="torch")),
            ("fp32", float_dir, dict(dtype="float32")),
            ("bf16", float_dir, dict(dtype="bfloat16")),
            ("Q4_0 at load / fp32", float_dir, dict(dtype="float32", quantization="int4")),
        ]
        print(f"{'variant':<22} {'expert MiB':>10} {'decode b1 tok/s':>16} {f'c{args.conc} tok/s':>10}")
        for name, folder, opts in variants:
            llm = LLM(str(folder), threads=args.threads, **opts)
            b1, cN = measure(llm, new, args.conc, args.repeat)
            print(f"{name:<22} {expert_bytes(llm) / 2**20:>10.1f} {b1:>16.1f} {cN:>10.1f}")
            del llm


if __name__ == "__main__":
    main()
