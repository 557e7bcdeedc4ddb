"""`mlaserve verify MODEL --against OTHER`'s report in words and as JSON: the table of blocks (rel / tol per
attention and MoE|MLP block, the free-running hidden state's difference, the tensor types), the lossy choices'
added error beside the file's own, and the verdict naming the first divergence (entrypoints/verify_against.py
computes the report; its notation holds here)."""

from __future__ import annotations

from pathlib import Path

from mlaserve.entrypoints.verify_against import FP32_REL_TOL, QUANT_SAFETY, AgainstReport, BlockDiff


def _part(block: str, kinds: tuple[str, ...]) -> str:
    if block in ("embed", "logits"):
        return block
    _, i, part = block.split(".")
    return "attention" if part == "attn" else ("MoE" if kinds[int(i)] == "moe" else "MLP")


def describe_failure(report: AgainstReport) -> str:
    f = report.first_failure
    if f is None:
        bad = [p for p, c in report.dequant_checks if not c.passed]
        return (
            f"dequantized tensors of {', '.join(bad)} differ from the gguf package's"
            if bad
            else ("no block diverges beyond its tolerance")
        )
    where = f.block if f.block in ("embed", "logits") else f"layer {f.block.split('.')[1]}"
    return (
        f"first divergence: {where} ({_part(f.block, report.mlp_kinds)}): rel {f.rel_diff:.2e} > tol "
        f"{f.tolerance:.2e}, cosine {f.cosine:.6f}"
    )


def _types_cell(types: dict[str, dict[str, int]], *blocks: str) -> str:
    merged: dict[str, int] = {}
    for b in blocks:
        for t, n in types.get(b, {}).items():
            merged[t] = merged.get(t, 0) + n
    return " ".join(f"{t}x{n}" for t, n in sorted(merged.items()))


def format_report(report: AgainstReport) -> str:
    by_name = {b.block: b for b in report.blocks}
    head = (
        f"{'layer':<6} {'attention rel/tol':<22} {'MoE|MLP rel/tol':<22} "
        f"{'output max|diff|':>16} {'rel':>9} {'cosine':>10}"
    )
    if report.types:
        head += f"  tensor types ({Path(report.model).name})"
    lines = [f"MODEL {report.model}  vs  OTHER {report.against}: {report.num_tokens} tokens, float32", head]
    lines.append(_edge_row("embed", by_name["embed"], _types_cell(report.types, "embed")))
    for lay in report.layers:
        a, m = by_name[f"layer.{lay.layer}.attn"], by_name[f"layer.{lay.layer}.mlp"]
        types = _types_cell(report.types, a.block, m.block)
        lines.append(
            f"{lay.layer:<6} {_cell(a):<22} {_cell(m):<22} {lay.max_abs_diff:>16.2e} {lay.rel_diff:>9.2e} "
            f"{lay.cosine:>10.6f}  {types}".rstrip()
        )
    lines.append(_edge_row("logits", by_name["logits"], _types_cell(report.types, "logits")))
    lines.append(f"final logits, free-running: top-1 agreement {report.logits_top1:.1%}")
    if report.activation_error:
        title = (
            f"int8 activations ({report.activations}): error their products add / the file's own e(X), per block "
            "(not judged; the rule: well inside e)"
        )
        lines += _against_file_error(title, report.activation_error, report.file_error, digits=2)
    if report.cache_error:
        title = (
            f"cache rows in {report.kv_cache_dtype}: error they add to the attention block / the file's own e(X) "
            "(not judged; the rule for a lossy default: well inside e)"
        )
        lines += _against_file_error(title, report.cache_error, report.file_error, digits=4)
    if report.topk_overlap:
        shared = ", ".join(f"layer {i} {v:.1%}" for i, v in report.topk_overlap.items())
        lines.append(f"DSA top-k rows shared with OTHER (MODEL attended over OTHER's; not judged): {shared}")
    lines += [f"note: {n}" for n in report.notes]
    lines += [f"{Path(p).name}: {c.describe()}" for p, c in report.dequant_checks]
    lines.append(("PASS: " if report.passed else "FAIL: ") + describe_failure(report))
    return "\n".join(lines)


def _against_file_error(title: str, added: dict[str, float], file_error: dict[str, float], digits: int) -> list[str]:
    """A lossy choice's added error per block beside the file's own quantization error e(X), and their ratio."""
    lines = [title]
    for b, err in added.items():
        e = file_error.get(b, 0.0)
        lines.append(f"  {b:<14} {err:.2e} / {e:.2e}" + (f"  = {err / e:.{digits}f}" if e else ""))
    return lines


def _cell(b: BlockDiff) -> str:
    return f"{b.rel_diff:.1e}/{b.tolerance:.1e} {'ok' if b.passed else 'FAIL'}"


def _edge_row(name: str, b: BlockDiff, types: str) -> str:
    row = f"{name:<6} {_cell(b):<22} {'':<22} {b.max_abs_diff:>16.2e} {b.rel_diff:>9.2e} {b.cosine:>10.6f}  {types}"
    return row.rstrip()


def to_json(report: AgainstReport) -> dict:
    f = report.first_failure
    return {
        "model": report.model,
        "against": report.against,
        "num_tokens": report.num_tokens,
        "passed": report.passed,
        "first_divergence": None
        if f is None
        else {
            "block": f.block,
            "layer": None if f.block in ("embed", "logits") else int(f.block.split(".")[1]),
            "sub_block": _part(f.block, report.mlp_kinds),
        },
        "blocks": [{**vars(b), "passed": b.passed} for b in report.blocks],
        "layers": [vars(x) for x in report.layers],
        "logits_top1_free_running": report.logits_top1,
        "topk_overlap": report.topk_overlap,
        "tensor_types": report.types,
        "notes": report.notes,
        "dequant_checks": [
            {"path": p, "available": c.available, "checked": c.checked, "mismatches": [list(m) for m in c.mismatches]}
            for p, c in report.dequant_checks
        ],
        "tolerance_rule": {"fp32_rel_tol": FP32_REL_TOL, "quant_safety": QUANT_SAFETY},
        "activations": report.activations,
        "activation_error": {
            b: {"rel": v, "file_error": report.file_error.get(b, 0.0)} for b, v in report.activation_error.items()
        },
        "kv_cache_dtype": report.kv_cache_dtype,
        "cache_error": {
            b: {"rel": v, "file_error": report.file_error.get(b, 0.0)} for b, v in report.cache_error.items()
        },
    }
