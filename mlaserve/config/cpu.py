"""What the CPU can do fast, for choices that depend on it (dtype="auto").

bf16 matmuls are ~2x faster than fp32 on CPUs with AVX512-BF16 or AMX-BF16 (measured on 2-core EPYCs
with AVX512-BF16) and ~4x slower without (AVX2 only: torch converts and multiplies in fp32). The flags
come from /proc/cpuinfo; MLASERVE_FAST_BF16=1|0 overrides the detection (the test suite sets 0 so its
outcomes never depend on the machine it runs on; tests of the choice set it both ways); MLASERVE_AMX_INT8=1|0
the same for AMX-INT8 (prefill_matmul="auto": int8 prefill products on the tiles); MLASERVE_INT8_ROWS=1|0 the same for
the VNNI dot products (prefill_matmul="auto" without the tiles: the routed experts' int8 products on the row kernels).
"""

from __future__ import annotations

import os
from pathlib import Path

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
OVERRIDE = "MLASERVE_FAST_BF16"


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def detected(override: str, flags: tuple[str, ...], absent: str) -> tuple[bool, str]:
    """(whether the CPU has any of `flags`, why: the override variable set to 1 / 0, the first flag found, or
    `absent`)."""
    forced = os.environ.get(override)
    if forced in ("0", "1"):
        return forced == "1", f"{override}={forced} in the environment"
    found = [f for f in flags if f in cpu_flags()]
    if found:
        return True, f"this CPU has {found[0]}"
    return False, absent


def fast_bf16() -> tuple[bool, str]:
    """(whether bf16 compute is fast on this CPU, why: the flag found, its absence, or the override)."""
    return detected(OVERRIDE, BF16_FLAGS, "this CPU has neither AVX512-BF16 nor AMX-BF16")


AMX_INT8_OVERRIDE = "MLASERVE_AMX_INT8"


def amx_int8() -> tuple[bool, str]:
    """(whether the CPU has AMX-INT8 tiles, why: the flag, its absence, or the override MLASERVE_AMX_INT8=1|0, which
    the test suite sets to 0 as it does MLASERVE_FAST_BF16). The automatic prefill choice asks it only where bf16 is
    fast (fast_bf16): it pairs the tiles with bf16 GEMMs above their rows."""
    return detected(AMX_INT8_OVERRIDE, ("amx_int8",), "this CPU has no AMX-INT8")


INT8_ROWS_OVERRIDE = "MLASERVE_INT8_ROWS"
VNNI_FLAGS = ("avx512_vnni", "avx_vnni")


def int8_rows() -> tuple[bool, str]:
    """(whether the CPU has the VNNI int8 dot products the int8 row kernels run on, why: the flag, its absence, or the
    override MLASERVE_INT8_ROWS=1|0, which the test suite sets to 0 as it does MLASERVE_AMX_INT8). The automatic
    prefill choice asks it where bf16 is fast and there are no AMX-INT8 tiles: the q8_K types' products then stay
    int8 on the int8 panels (AVX512-VNNI's 16-row ones, else AVX2's 8-row ones: native.panel_rows), and routed experts
    of other int8 types up to kernels/ggml.ROW_KERNEL_ROWS rows per expert on the row kernels."""
    return detected(INT8_ROWS_OVERRIDE, VNNI_FLAGS, "this CPU has no VNNI int8 dot products")


def int8_row_kernels() -> tuple[bool, str]:
    """(whether the CPU runs the int8 row kernels on integer dot products: VNNI's, or AVX2's vpmaddubsw + vpmaddwd,
    why; the same override as int8_rows, MLASERVE_INT8_ROWS=1|0). prefill_matmul="auto" asks it where bf16 GEMMs are
    slow (int8_float: the int8 products on the panels and row kernels, measured faster than fp32 on an AVX2 CPU)."""
    return detected(
        INT8_ROWS_OVERRIDE, (*VNNI_FLAGS, "avx2"), "this CPU has neither VNNI nor AVX2 integer dot products"
    )


INT16_ROWS_OVERRIDE = "MLASERVE_INT16_ROWS"


def int16_rows() -> tuple[bool, str]:
    """(whether the CPU has the int16 dot products the int16-activation products run on: AVX512-VNNI's vpdpwssd, or
    AVX2's vpmaddwd (decode rows only: csrc/x86/int16_rows.c), why: the flag, its absence, or the override
    MLASERVE_INT16_ROWS=1|0, which the test suite sets to 0 as it does MLASERVE_INT8_ROWS). activations="auto" asks
    it: the 32-value block types its int8 cap leaves in fp32 (Q8_0, Q5_0, MXFP4) then take int16 activations at
    every decode row count (kernels/int16_prefill.py)."""
    return detected(INT16_ROWS_OVERRIDE, ("avx512_vnni", "avx2"), "this CPU has neither AVX512-VNNI nor AVX2")
