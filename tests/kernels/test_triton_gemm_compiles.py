"""The Triton kernels of mlaserve/kernels/triton/ compile for a CUDA GPU (sm_90) on a machine without one: Triton
lowers them to PTX and its bundled ptxas to a cubin, so code that only the interpreter accepts fails here, in CPU
CI, not first on a GPU. The decode kernels' and the latent write's PTX holds no fused multiply-add with fp fusion
off (the launch's tiles.LAUNCH: enable_fp_fusion=False), and would with it on (Q4_K's (d * sc) * q - dmin * m,
the rope's x1 cos - x2 sin: an FMA skips a rounding, and the decode would no longer equal gguf-py's, the rope
the reference's, bit for bit).

A subprocess: the kernels must be defined with TRITON_INTERPRET unset (tests/conftest.py sets it where torch sees
no GPU), and Triton reads it when a kernel is defined. Marked slow (it starts a process; ~10 s of compiling).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mlaserve.kernels.triton import fp8_block_gemm, gguf_q4_k, gguf_q8_0, latent_write, tiles

def sig(ptrs, ints, consts):
    return {**ptrs, **{n: "i32" for n in ints}, **{n: "constexpr" for n in consts}}

tile = {"BM": 16, "BN": 64, "BK": 64}
fp8 = {"BLOCK_N": 128, "BLOCK_K": 128}
cases = {
    "fp8_gemm": (fp8_block_gemm._gemm, sig({"x_ptr": "*fp32", "q_ptr": "*u8", "s_ptr": "*fp32", "y_ptr": "*fp32"},
                 ["M", "N", "K", "KB"], [*fp8, *tile]), {**fp8, **tile}),
    "fp8_decode": (fp8_block_gemm._decode, sig({"q_ptr": "*u8", "s_ptr": "*fp32", "w_ptr": "*fp32"},
                   ["N", "K", "KB"], [*fp8, "BN", "BK"]), {**fp8, "BN": 64, "BK": 64}),
}
# the GGUF formats: tiles.py's shared kernel bodies, each format's tile decoder passed as the constexpr DECODE
for name, mod, q in (("q8_0", gguf_q8_0, "*i8"), ("q4_k", gguf_q4_k, "*u8")):
    dec = {"DECODE": mod.decode_tile}
    cases[name + "_gemm"] = (tiles.gguf_gemm, sig({"x_ptr": "*fp32", "q_ptr": q, "d_ptr": "*fp16", "y_ptr": "*fp32"},
                             ["M", "N", "K"], [*dec, *tile]), {**dec, **tile})
    cases[name + "_decode"] = (tiles.gguf_decode, sig({"q_ptr": q, "d_ptr": "*fp16", "w_ptr": "*fp32"}, ["N", "K"],
                               [*dec, "BN", "BK"]), {**dec, "BN": 64, "BK": 64})
# the latent write (kv_a norm, rope, cache row): DeepSeek's r 512, dr 64, interleaved rope, 16 heads per tile
lw = {"INTERLEAVED": True, "BR": 512, "BHALF": 32, "BH": 16}
cases["latent_write"] = (latent_write._latent_write, sig(
    {n: "*fp32" for n in ("kv_ptr", "q_ptr", "w_ptr", "cos_ptr", "sin_ptr")} | {"slot_ptr": "*i64",
     "cache_ptr": "*fp32", "qpe_ptr": "*fp32", "eps": "fp32"},
    ["R", "H", "DN", "HALF", "stride_kv", "stride_qt", "stride_qh", "stride_cache", "stride_cs"], [*lw]), lw)
target = GPUTarget("cuda", 90, 32)
out = {}
for name, (fn, signature, consts) in cases.items():
    k = triton.compile(ASTSource(fn, signature, consts), target=target, options=dict(tiles.LAUNCH))  # the launch's
    out[name] = {"cubin": len(k.asm["cubin"]), "fma": k.asm["ptx"].count("fma.rn.f32")}
fn, signature, consts = cases["q4_k_decode"]
fused = triton.compile(ASTSource(fn, signature, consts), target=target, options={"enable_fp_fusion": True})
out["q4_k_decode_fused"] = {"cubin": len(fused.asm["cubin"]), "fma": fused.asm["ptx"].count("fma.rn.f32")}
print(json.dumps(out))
"""


def test_kernels_compile_for_sm90_without_fused_decode_arithmetic(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton has no CUDA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(v["cubin"] > 0 for v in got.values()), got
    assert all(got[n]["fma"] == 0 for n in ("fp8_decode", "q8_0_decode", "q4_k_decode", "latent_write")), got
    assert got["q4_k_decode_fused"]["fma"] > 0, got  # what enable_fp_fusion=False prevents
