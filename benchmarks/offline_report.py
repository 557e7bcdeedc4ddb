"""The report of benchmarks/offline.py's run: the table (a row per measure, a column per engine, then the ratios
of engine pairs) printed with the engines that failed or were left out, the greedy agreement, the roofline and
the machine's load."""

from __future__ import annotations

import os
from pathlib import Path

from offline_engines import Engine


# -- the report -----------------------------------------------------------------------------------------
def ratio_pairs(engines: list[Engine]) -> list[tuple[str, str]]:
    """mlaserve on the folder / transformers (same weights, same dtype); every mlaserve engine / the
    llama.cpp engine on the same GGUF (the Q8_0 one for mlaserve on the folder)."""
    tf = next((e.spec for e in engines if e.kind == "transformers"), None)
    pairs = [(e.spec, tf) for e in engines if e.kind == "mlaserve" and tf]
    for kind in ("llama.cpp", "ik_llama.cpp"):
        lc = {}
        for e in engines:
            if e.kind == kind:
                lc.setdefault(e.weights, e.spec)
        for e in engines:
            other = lc.get(e.weights) or lc.get("q8_0") or next(iter(lc.values()), None)
            if e.kind.startswith("mlaserve") and other:
                pairs.append((e.spec, other))
    return pairs


def _value(res: dict, spec: str, key: str, sub=None):
    v = res.get(spec, {}).get(key)
    if sub is not None:
        v = (v or {}).get(sub)
    if isinstance(v, dict):
        v = v.get("measured")
    return v


def table_rows(s: dict) -> list[tuple[str, str, object, str]]:
    """(label, key, sub, better)."""
    rows = [
        (f"prefill tok/s ({s['prefill_len']}-token prompt)", "prefill_tok_s", None, "higher"),
        (f"decode tok/s, batch 1 ({s['dec_prompt']}+{s['dec_new']})", "decode_tok_s_b1", None, "higher"),
        (
            f"decode tok/s, batch 1 at context {s['long_prompt']} (+{s['long_new']})",
            "decode_tok_s_long",
            None,
            "higher",
        ),
    ]
    for b in s["concs"]:
        rows.append(
            (f"output tok/s, {b} concurrent ({s['conc_prompt']}+{s['conc_new']})", f"output_tok_s_c{b}", None, "higher")
        )
        rows.append((f"  decode-only tok/s, {b} concurrent", f"decode_tok_s_c{b}", None, "higher"))
    rows.append(("peak RSS GiB (VmHWM of its process)", "peak_rss_gib", None, "lower"))
    rows.append(("  peak RSS / size of the weight file", "rss_over_weights", None, "lower"))
    rows.append(("KV cache bytes/token (all layers)", "kv_bytes_per_token", None, "lower"))
    rows += [(f"decode step ms @ context {n}", "step_ms", n, "lower") for n in s["contexts"]]
    rows.append(("batch-1 roofline tok/s (copy bw / active bytes)", "roofline_tok_s", None, "-"))
    rows.append(("  decode batch 1 / roofline", "roofline_share", None, "higher"))
    return rows


def _cell(e: Engine, v, key: str, fmt) -> str:
    if v is None:
        return "failed" if e.status else "-"
    if key == "roofline_share":
        return f"{v:.0%}"
    return fmt(v, 2 if key in ("peak_rss_gib", "rss_over_weights") else 1)


def report(args, s: dict, engines: list[Engine], res: dict, roof: dict, env: dict, wall: float, skipped: dict) -> str:
    for e in engines:
        f = roof["formats"].get(roof["engine_format"].get(e.spec))
        if f and e.spec in res:
            res[e.spec]["roofline_tok_s"] = f["roofline_tok_s"]
            d = res[e.spec].get("decode_tok_s_b1")
            res[e.spec]["roofline_share"] = d / f["roofline_tok_s"] if d else None
    pairs = ratio_pairs(engines)
    headers = ["metric"] + [e.spec for e in engines] + [f"{a} / {b}" for a, b in pairs] + ["better"]
    from common import fmt, print_table

    rows = []
    for label, key, sub, better in table_rows(s):
        vals = [_value(res, e.spec, key, sub) for e in engines]
        cells = [_cell(e, v, key, fmt) for e, v in zip(engines, vals)]
        ratios = []
        for a, b in pairs:
            va, vb = _value(res, a, key, sub), _value(res, b, key, sub)
            ok = va and vb and key not in ("roofline_tok_s", "roofline_share")
            ratios.append(f"{va / vb:.2f}x" if ok else "-")
        rows.append([label] + cells + ratios + [better])
    print()
    print(
        f"offline benchmark -- dtype {args.dtype} (folder engines), {args.threads} threads, "
        f"{args.model} model{' QUICK (2 layers)' if args.quick else ''}"
        + "".join(f", {Path(env['weights'][k]).name} ({mib:.0f} MiB)" for k, mib in env["gguf_mib"].items())
    )
    table = print_table(headers, rows)
    for e in engines:
        if e.status:
            print(f"{e.spec}: {e.status}")
    for sp, why in skipped.items():
        print(f"{sp}: not run ({why})")
    agree = res.get("greedy_agreement_b1", {})
    if agree:
        print(
            "greedy agreement (leading identical tokens, batch 1): " + "; ".join(f"{k} {v}" for k, v in agree.items())
        )
    print(
        f"roofline: copy bandwidth {roof['copy_bandwidth_gbs']:.1f} GB/s; active weight bytes per token: "
        + "; ".join(
            f"{k} {v['bytes'] / 1e6:.0f} MB -> {v['roofline_tok_s']:.1f} tok/s" for k, v in roof["formats"].items()
        )
    )
    env["loadavg_end"] = list(os.getloadavg())
    print(
        f"wall time {wall:.0f} s; loadavg start {env['loadavg_start']} end {env['loadavg_end']} "
        f"(other processes share the {env['cpus']} CPUs: absolute numbers are pessimistic)"
    )
    return table
