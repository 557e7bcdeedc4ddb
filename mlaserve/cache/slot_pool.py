"""The pool of state slots: which running request owns which slot of the "request"-addressed cache states.

Plain bookkeeping (ids, no tensors): the scheduler owns it on the scheduling rank, beside the page pool,
and only when the model declares a request state (config/layer_kinds.py: `request_states`); a model with
paged states only has no slot pool and no slot in any SeqChunk. The tensors the slots index live in
`cache.model_cache` ([num_slots + 1, ...] per request state: the last slot is the zero pad slot).

Lifecycle: a slot is taken when a request is admitted to the running set and given back when it leaves
it (finish, abort, failure, preemption). A freed slot's stale contents are never read: the first chunk
of every (re-)admitted request says `reset_state` (the runner zeroes its slot before the step) or, at a
prefix hit, `restore_page` (the runner zeroes it and copies the page's snapshot rows in).
Slots are handed out most recently freed first (a stack; the never-used ones in ascending order after those): a
state's memory becomes resident slot by slot as slots are first written (model_cache._zeros), so reusing a resident
slot keeps the process's memory at the most slots ever held at once (handing them out in the order they were freed
walked through every slot in time).
"""

from __future__ import annotations


class SlotPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: the last one is handed out next
        self.owner: dict[int, str] = {}  # slot -> request id holding it

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str) -> int:
        """A free slot for this request; the caller checks num_free first (admission waits, never fails)."""
        if not self._free:
            raise RuntimeError(f"request {request_id}: no free state slot ({self.num_slots} all held)")
        slot = self._free.pop()
        self.owner[slot] = request_id
        return slot

    def free(self, slot: int, request_id: str) -> None:
        holder = self.owner.get(slot)
        if holder != request_id:
            raise RuntimeError(f"request {request_id}: frees state slot {slot}, which is held by {holder!r}")
        del self.owner[slot]
        self._free.append(slot)
