"""A prompt through a ModelRunner in chunks, by hand: the prefix-cache tests of the request-state models
(DeepSeek-V4, Kimi-Linear, GLM-5.3-Flash) drive the runner directly so that a hit can end on any page boundary."""

from __future__ import annotations

import torch

from mlaserve.executor.forward_batch import SeqChunk


def prefill_in_chunks(runner, rid, ids, done, table, slot, budget, first_restore=None) -> torch.Tensor:
    """ids[done:] through the runner in chunks of `budget`, all logits; the first chunk resets the slot (done 0)
    or restores it from `first_restore` (the page a prefix hit ending at `done` restores from); `table` the
    request's pages (as many as each chunk's end needs are passed)."""
    ps, out, start = runner.cfg.cache.page_size, [], done
    while done < len(ids):
        chunk = tuple(ids[done : done + budget])
        seq = SeqChunk(
            rid,
            chunk,
            done,
            tuple(table[: -(-(done + len(chunk)) // ps)]),
            all_logits=True,
            state_slot=slot,
            reset_state=done == 0,
            restore_page=first_restore if done == start and done > 0 else None,
        )
        out.append(runner.execute([seq])[1])
        done += len(chunk)
    return torch.cat(out)
