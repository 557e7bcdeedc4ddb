"""`mlaserve verify` on a DeepSeek-V4 model: the identities of its window + compressed-row attention.

Each pair runs the prompt through two schedules that must agree (prompt logits at every position):
  chunked prefill (c) vs one pass  per compression ratio m, chunks of m - 1 and m + 1 tokens: chunk j ends at
                                   j*c, so the chunk ends walk through every residue mod m (j*(m+1) = j mod m)
                                   and a compressor resumes a half-filled window at each of them; the name says
                                   how many residues the prompt's length let the ends reach. Every position's
                                   logits are compared, so every prompt length 1..N (every length mod m) is too
  prefill then decode vs one pass  half the prompt in one chunk, the rest one token per step (the serving path:
                                   decodes continue the prefill's carry, ring and pools)
  batch vs each alone              three sequences in the same steps (one decoding every step beside prefills
                                   of 3 tokens and of a whole prompt), each against the same schedule alone
  CSA sparse vs dense              the prompt cut to the longest length whose CSA rows fit in index_topk: the
                                   indexer's top-k must keep every visible row, so the CSA layers equal the
                                   same layers attending every visible row (ModelRunner.v4_csa_dense, a
                                   switch recorded in the route: path "window+csa(dense)", sparse False)
What these cannot see: a fault every schedule shares (the weights, the one-pass math itself); the tests
compare that with transformers (tests/identities/test_deepseek_v4_engine.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mlaserve.attention.router import V4_PATHS
from mlaserve.config.engine import EngineConfig
from mlaserve.config.layer_kinds import LayerKind
from mlaserve.entrypoints.verify_v4_pins import pinned_run, recorded
from mlaserve.executor.forward_batch import SeqChunk
from mlaserve.executor.model_runner import ModelRunner

Pair = tuple[str, torch.Tensor, torch.Tensor] | tuple[str, torch.Tensor, torch.Tensor, str]  # (.., note)


def is_v4(layers: tuple[LayerKind, ...]) -> bool:
    return any(k.attention in V4_PATHS for k in layers)  # the router's V4 kinds


def schedule_logits(
    model, cfg: EngineConfig, seqs: dict[str, tuple[list[int], list[int]]], csa_dense: bool = False
) -> dict[str, torch.Tensor]:
    """Prompt logits of several sequences run together: sequence r is (ids, chunk sizes); step j holds chunk j
    of every sequence that has one (each in its own state slot and pages, of a fresh runner's own cache).
    csa_dense: the runner routes V4's CSA layers dense (ModelRunner.v4_csa_dense). -> r: logits [len(ids), vocab]."""
    ps = cfg.cache.page_size
    pages_of = {r: -(-len(ids) // ps) for r, (ids, _) in seqs.items()}
    cfg = replace(
        cfg,
        cache=replace(cfg.cache, num_pages=sum(pages_of.values()) + 1),
        scheduler=replace(
            cfg.scheduler,
            max_num_seqs=len(seqs),
            max_num_batched_tokens=max(1, sum(len(ids) for ids, _ in seqs.values())),
        ),
    )
    runner = ModelRunner(model, cfg, v4_csa_dense=csa_dense)
    first, tables = 0, {}
    for r, n in pages_of.items():
        tables[r], first = list(range(first, first + n)), first + n
    out: dict[str, list[torch.Tensor]] = {r: [] for r in seqs}
    done = dict.fromkeys(seqs, 0)
    for j in range(max(len(sizes) for _, sizes in seqs.values())):
        chunks = []
        for slot, (r, (ids, sizes)) in enumerate(seqs.items()):
            if j >= len(sizes):
                continue
            d, n = done[r], sizes[j]
            table = tuple(tables[r][: -(-(d + n) // ps)])
            chunks.append(
                SeqChunk(r, tuple(ids[d : d + n]), d, table, all_logits=True, state_slot=slot, reset_state=d == 0)
            )
            done[r] = d + n
        batch, logits = runner.execute(chunks)
        for (r, _), row in zip(batch.logits_owner, logits):
            out[r].append(row)
    return {r: torch.stack(rows) for r, rows in out.items()}


def _sizes(n: int, chunk: int) -> list[int]:
    return [min(chunk, n - d) for d in range(0, n, chunk)]


def _alone(llm, cfg: EngineConfig, ids: list[int], sizes: list[int], csa_dense: bool = False) -> torch.Tensor:
    return schedule_logits(llm.loaded.model, cfg, {"verify": (ids, sizes)}, csa_dense)["verify"]


def v4_pairs(
    llm, base: EngineConfig, ids: list[int], full: torch.Tensor, decoded: torch.Tensor, log: dict | None = None
) -> list[Pair]:
    """The V4 identities on `ids` (full, decoded: their logits through `base` in one pass and token by token,
    the latter also the decoding sequence's schedule alone in the batch check). log: the one pass's rows
    entering the official roundings (verify_v4_pins.py), None without them; with it the one-sequence schedules
    take the one pass's rounding decisions where their rows are the same up to fp32 noise."""
    layers = llm.runner.layer_kinds
    model = llm.loaded.model
    n, pairs = len(ids), []
    ratios = sorted({k.ratio for k in layers if k.ratio})
    chunked: dict[int, torch.Tensor] = {}
    for m in ratios:
        for c in (m - 1, m + 1):
            if c < 2 or c >= n or c in chunked:  # 1 is token by token; >= n is one pass
                continue
            chunked[c], note = pinned_run(model, log, lambda c=c: _alone(llm, base, ids, _sizes(n, c)))
            reached = {(j * c) % m for j in range(1, -(-n // c))}
            name = f"chunked prefill ({c}) vs one pass: chunk ends at {len(reached)}/{m} residues mod {m}"
            pairs.append((name, chunked[c], full, note))
    if n > 1:
        half = n // 2
        then, note = pinned_run(model, log, lambda: _alone(llm, base, ids, [half] + [1] * (n - half)))
        pairs.append(("prefill then decode vs one pass", then, full, note))
        # the batch: the prompt decoding every step, beside it in 3-token chunks and a shifted prompt in one pass
        other = ids[1:] + ids[:1]
        three = _sizes(n, 3)
        together = schedule_logits(
            llm.loaded.model,
            base,
            {"decoding": (ids, [1] * n), "chunks_of_3": (ids, three), "one_pass": (other, [n])},
        )
        # several sequences' rows share each call there, so no record lines up with them: judged unpinned, the
        # single runs beside them unpinned too
        alone = {
            "decoding": decoded if log is None else _alone(llm, base, ids, [1] * n),
            "chunks_of_3": chunked[3] if 3 in chunked and log is None else _alone(llm, base, ids, three),
            "one_pass": _alone(llm, base, other, [n]),
        }
        worst = max(alone, key=lambda r: (together[r] - alone[r]).abs().max().item())
        pairs.append((f"batch of 3 vs each alone (worst: {worst})", together[worst], alone[worst]))
    csa = next((k for k in layers if k.attention == "v4_csa" and k.topk), None)
    if csa is not None:
        # the longest prompt whose visible CSA rows ((t+1) // m at its last position) fit in index_topk
        short = ids[: min(n, (csa.topk + 1) * csa.ratio - 1)]
        with recorded(model) as dense_log:
            dense = _alone(llm, base, short, [len(short)], csa_dense=True)
        sparse, note = pinned_run(
            model, dense_log if log is not None else None, lambda: _alone(llm, base, short, [len(short)])
        )
        name = f"CSA sparse vs dense, rows within index_topk ({len(short)} tokens, <= {csa.topk} rows)"
        pairs.append((name, sparse, dense, note))
    return pairs
