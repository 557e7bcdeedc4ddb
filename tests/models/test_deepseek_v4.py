"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM on the same random weights (fp32).

Bound: 1e-5 max abs on logits of magnitude ~4. Measured on these configs: one pass 0.7e-6 .. 1.6e-6, chunked
and token by token up to ~3e-6 (the chunked paths sum attention over differently shaped key sets, and the
pooled rows of a window closed across chunks are computed from the same values in another grouping; fp32
rounding at these sizes). A real defect (a wrong window edge, a lost carry, a mis-ordered rope pair) moves
logits by 1e-2 .. 1 (measured by breaking each, see the report), far above the bound.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from state_engine import assert_close  # noqa: E402
from v4_models import SPECS, build_hf_v4, hf_v4_logits, largest_ratio, ours_from_hf  # noqa: E402

BOUND = 1e-5
DECODE_AFTER = 2  # tokens decoded one by one after each prompt, through the state


@pytest.fixture(scope="module", params=list(SPECS))
def pair(request):
    hf = build_hf_v4(request.param, seed=1)
    return request.param, hf, ours_from_hf(hf)


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, vocab, (n - 1,), generator=g).tolist()


def _run(model, ids: list[int], chunks: list[int], max_tokens: int) -> torch.Tensor:
    """Logits of every position, feeding `ids` in chunks of the given sizes (cycled) through one state."""
    state, out, i, k = model.new_state(max_tokens), [], 0, 0
    with torch.no_grad():
        while i < len(ids):
            n = chunks[k % len(chunks)]
            out.append(model(torch.tensor(ids[i : i + n]), state))
            i, k = i + n, k + 1
    assert state.length == len(ids)
    return torch.cat(out)


def test_one_pass_matches_transformers(pair):
    kind, hf, ours = pair
    ids = _ids(3 * largest_ratio(kind) + 13, hf.config.vocab_size, 0)
    assert_close(_run(ours, ids, [len(ids)], len(ids)), hf_v4_logits(hf, ids), BOUND, kind)


def test_every_prompt_length_one_pass_chunked_token_by_token(pair):
    """Each prompt length 1 .. 3 x the largest ratio + 5, prefilled in one pass or in chunks of 1, 3, 4, 7, then
    DECODE_AFTER tokens one by one: every position equals transformers' one-pass logits (a prompt ending
    mid-window leaves a carry the decode steps must continue from). Prompts chunked alike share their whole
    chunks: the state after them is forked (clone) into each prompt's last partial chunk and decode steps."""
    kind, hf, ours = pair
    longest = 3 * largest_ratio(kind) + 5
    ids = _ids(longest + DECODE_AFTER, hf.config.vocab_size, 1)
    ref = hf_v4_logits(hf, ids)  # causal: its first n rows are the logits of the first n tokens
    # chunk 1 is token by token: one run covers every prompt length
    assert_close(_run(ours, ids, [1], len(ids)), ref, BOUND, f"{kind} token by token")
    checked = 0
    with torch.no_grad():
        for length in range(1, longest + 1):  # one pass
            state = ours.new_state(len(ids))
            out = [ours(torch.tensor(ids[:length]), state)]
            out += [ours(torch.tensor([t]), state) for t in ids[length : length + DECODE_AFTER]]
            assert_close(torch.cat(out), ref[: length + DECODE_AFTER], BOUND, f"{kind} prompt {length} one pass")
            checked += 1
        for chunk in (3, 4, 7):
            state, done, b = ours.new_state(len(ids)), [], 0  # state after ids[:b] in whole chunks
            while b < longest:
                for r in range(1, chunk + 1):
                    length = b + r
                    if length > longest:
                        break
                    fork = state.clone()
                    out = [ours(torch.tensor(ids[b:length]), fork)]
                    if r == chunk:
                        after, last = fork.clone(), out[0]
                    out += [ours(torch.tensor([t]), fork) for t in ids[length : length + DECODE_AFTER]]
                    what = f"{kind} prompt {length} chunk {chunk}"
                    assert_close(torch.cat(done + out), ref[: length + DECODE_AFTER], BOUND, what)
                    checked += 1
                if b + chunk < longest:
                    state, b = after, b + chunk
                    done.append(last)
                else:
                    break
    assert checked == 4 * longest


def test_greedy_through_the_state_equals_full_recompute(pair):
    kind, hf, ours = pair
    prompt = _ids(11, hf.config.vocab_size, 2)
    ids = list(prompt)
    for _ in range(32):  # transformers, recomputing the whole sequence at each step
        ids.append(int(hf_v4_logits(hf, ids)[-1].argmax()))
    assert ours.generate_greedy(prompt, 32) == ids[len(prompt) :]


def test_the_sweep_reaches_the_boundaries():
    """The configs make the sweep meaningful: CSA/HCA windows close inside the prompts, the indexer has more
    visible rows than index_topk (its choice matters), and a prompt can end with a partly filled window."""
    hf = build_hf_v4("all_kinds", seed=1)
    ours = ours_from_hf(hf)
    n = 3 * largest_ratio("all_kinds") + 5  # 29
    state = ours.new_state(n)
    with torch.no_grad():
        ours(torch.tensor(_ids(n, hf.config.vocab_size, 0)), state)
    csa, hca = state.layers[1], state.layers[2]
    assert csa.pool.n == n // 4 and csa.pool.n > hf.config.index_topk and csa.carry.fill == n % 4
    assert csa.index_pool.n == n // 4 and csa.index_carry.fill == n % 4
    assert hca.pool.n == n // 8 and hca.carry.fill == n % 8


def test_rope_tables_are_transformers(pair):
    kind, hf, ours = pair
    rot = hf.model.rotary_emb
    for table in ("main", "compress"):
        assert torch.equal(ours.tables.inv_freq[table], getattr(rot, f"{table}_inv_freq")), table
        assert ours.tables.scale[table] == getattr(rot, f"{table}_attention_scaling"), table


def test_token_ids_reach_hash_routing():
    """Hash layers route by token id: the same hidden rows with other ids pick other experts."""
    hf = build_hf_v4("hc3_hash", seed=1)
    ours = ours_from_hf(hf)
    gate = ours.model.layers[0].mlp.gate
    x = torch.randn(4, hf.config.hidden_size)
    _, idx_a = gate(x, torch.tensor([5, 6, 7, 8]))
    _, idx_b = gate(x, torch.tensor([9, 10, 11, 12]))
    assert torch.equal(idx_a, gate.tid2eid[torch.tensor([5, 6, 7, 8])])
    assert not torch.equal(idx_a, idx_b)
