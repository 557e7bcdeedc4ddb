"""Rank 0's side of a tensor-parallel group: start the workers (fresh `python` processes, spawn.py;
gloo on CPU) or join torchrun's, check that every rank runs the same configuration, run each step on all ranks, and turn
any worker failure into one clear error naming the rank -- then stop every process.

Faults: a worker that raises leaves its report in the store; one that dies is seen by its exit
code; one that is alive but stuck is found by rank 0's watchdog (heartbeat.py: what it can and
cannot see), which names it, kills it when it is our child (SIGKILL: a stopped process ignores
SIGTERM until SIGCONT), and makes rank 0 stop waiting for the step's collective. A torchrun rank
is not ours to kill: the step still fails at once with the report, the group is failed, and the
rank is left to gloo's COLLECTIVE_TIMEOUT and its launcher.

Rank 0 owns the scheduler and the sampler. Each step it broadcasts the step's work (the scheduled
SeqChunks and preemptions: plain data); every rank builds the same ForwardBatch and route from it
and runs the forward on its slice; rank 0 gathers the logits (vocabulary slices) and, when
tracing, every rank's route record, and alone samples.

Speculative decoding (MTP) is one view, the leader's: rank 0 alone verifies the drafts, accepts and
chooses the next drafts (argmax of the gathered MTP logits); the other ranks never decide anything. A
verify step is a plain step whose chunks carry the drafts as tokens; each MTP pass is broadcast as its
chunks and the rows of hidden states it reads (TensorParallelDrafter): the trunk's last output or the last
pass's, which every rank holds itself (each the output of the same all-reduce and replicated ops), or,
for rows only rank 0 kept (a paused request's catch-up, engine/speculative.py), the rows themselves. So
every rank runs the same passes over the same inputs in the same order, and its caches hold the same rows.
Rejected drafts need no rollback on the MLA families: their rows are never read (attention is causal)
and the next step rewrites them. DeepSeek-V4's request states do (it is not split by tensor parallelism,
but spread by expert parallelism, its MTP layer's experts too): there rank 0 sends the verdict ("rollback")
and the deeper drafts' ring hold / end_draft, and every rank puts its own copy back. The ledger's speculative fields of a step (verify, draft depth) are rank 0's, copied into every
rank's record of that step; the switch and accept records are rank 0's alone.
"""

from __future__ import annotations

import signal
import time
import warnings
from dataclasses import replace

import torch

from mlaserve.config.engine import EngineOptions
from mlaserve.config.model import ConfigError
from mlaserve.distributed.collectives import CONNECT_TIMEOUT, Collectives, master_store
from mlaserve.distributed.heartbeat import Watchdog
from mlaserve.distributed.mesh import logits_sizes
from mlaserve.distributed.spawn import WorkerProcess
from mlaserve.distributed.worker import ERROR, JOINED, WorkerSpec, effective_config, rank_echo
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk
from mlaserve.executor.model_runner import ModelRunner
from mlaserve.loading.model_loader import LoadedModel, fill_model, open_checkpoint

FAULT_WAIT_S = 5.0  # how long rank 0 waits for a failed worker's own report before naming its death
STOP_WAIT_S = 5.0  # how long a worker gets to exit after "stop" before it is terminated


class TensorParallelError(RuntimeError):
    """A rank of the group failed; the message names the rank and its exception (or signal)."""


class TensorParallelGroup:
    """Rank 0's handle on the group: its collectives, the rendezvous store (where a failing rank
    leaves its report) and, on one machine, the worker processes it started."""

    def __init__(self, store, comm: Collectives | None, procs: list) -> None:
        self.store, self.comm, self.procs = store, comm, procs
        self.failure: str | None = None
        self.closed = False
        self.hung: dict[int, str] = {}  # rank -> the watchdog's report (set from its thread)
        self.watchdog: Watchdog | None = None
        self._failed_comm: Collectives | None = None
        self.unclean_exit: str | None = None  # a worker's non-zero exit after a healthy stop (shutdown)

    @classmethod
    def start(cls, path: str, opts: EngineOptions, rank_overrides: dict | None = None):
        """Start ranks 1..N-1 on this machine. rank_overrides {rank: {option: value}}: start a rank
        with different options (tests use it to prove that a rank whose configuration differs is
        caught)."""
        n = opts.tensor_parallel_size * opts.expert_parallel_size
        store = master_store(n)
        group = cls(store, None, [])
        for rank in range(1, n):
            rank_opts = replace(opts, **(rank_overrides or {}).get(rank, {}))
            spec = WorkerSpec(path, rank_opts, rank, n, "127.0.0.1", store.port)
            group.procs.append(group.guard(WorkerProcess, spec, f"mlaserve-tp-rank{rank}"))
        group.guard(group._wait_joined, store, n)
        group._connect(n)
        return group

    @classmethod
    def join(cls, store, world_size: int):
        """Rank 0 of a group whose processes were started by someone else (torchrun)."""
        group = cls(store, None, [])
        group._connect(world_size)
        return group

    def _connect(self, n: int) -> None:
        """Rank 0's collectives (interrupted when a rank is found hung), then the watchdog: every
        worker beats from before it connects, so the watchdog starts with every heartbeat there."""
        self.comm = self.guard(Collectives, self.store, 0, n, self.stop_reason)
        self.watchdog = Watchdog(self.store, range(1, n), self._on_hang).start()

    def _on_hang(self, rank: int, report: str) -> None:
        """The watchdog's verdict (its thread): record it, then kill the rank when it is ours; the
        step's collective on rank 0 then fails or is abandoned, and _diagnose names the rank."""
        proc = self.procs[rank - 1] if rank <= len(self.procs) else None
        if proc is not None and not proc.is_alive():
            return  # it exited, not hung: _diagnose names its exit (is_alive() here could race a join)
        action = "rank 0 killed it" if proc is not None else "not a process of ours (torchrun): not killed"
        self.hung[rank] = f"{report} ({action})"
        if proc is not None:
            proc.kill()

    def hang_report(self) -> str | None:
        """The first hung rank's report, or None (polled by rank 0's waits)."""
        for rank, report in sorted(self.hung.items()):
            return f"tensor-parallel rank {rank} {report}"
        return None

    def stop_reason(self) -> str | None:
        """Why rank 0 should stop waiting for a collective (polled every WAIT_SLICE): a hung rank (the watchdog),
        or a worker of ours that is no longer alive. A dead peer usually fails gloo's transfer at once, but not
        always: a collective that is not reading from its connection when the peer dies waits for
        COLLECTIVE_TIMEOUT (seen once in CI: a SIGKILLed EP rank, 300 s). _diagnose then names the cause."""
        hung = self.hang_report()
        if hung is not None:
            return hung
        for rank, proc in enumerate(self.procs, 1):
            if not proc.is_alive():
                return str(_died(rank, proc))
        return None

    def _wait_joined(self, store, n: int) -> None:
        """Until every worker reached the store (a worker that dies on the way is named at once)."""
        deadline = time.monotonic() + CONNECT_TIMEOUT.total_seconds()
        keys = [f"{JOINED}{r}" for r in range(1, n)]
        while not store.check(keys):
            if any(not p.is_alive() for p in self.procs):
                raise RuntimeError("a worker exited before joining the group")
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers did not join within {CONNECT_TIMEOUT}")
            time.sleep(0.05)

    def guard(self, fn, *args):
        """fn(*args); a failure of any rank stops the whole group and raises one error naming it."""
        if self.closed:
            raise TensorParallelError(self.failure or "the tensor-parallel group is shut down")
        try:
            return fn(*args)
        except BaseException as e:
            err = self._diagnose(e)
            self.failure = str(err)
            self.shutdown()
            if err is e:
                raise
            raise err from e

    def _diagnose(self, exc: BaseException) -> BaseException:
        """The cause, not a consequence: the watchdog's report on a hung rank, else a worker a signal
        ended, else a failed rank's own report (one whose collective lost a peer only after the
        others'), else which worker died and how; else exc (rank 0's own error). Under TP x EP a
        killed process's peers in its groups fail first with a gloo read error, which names them,
        not it: the dead process is the one to name."""
        if not isinstance(exc, RuntimeError) or isinstance(exc, TensorParallelError):
            return exc
        n = self.comm.world_size if self.comm is not None else len(self.procs) + 1
        keys = {r: f"{ERROR}{r}" for r in range(1, n)}
        deadline, since = time.monotonic() + FAULT_WAIT_S, None
        while time.monotonic() < deadline:
            hung = self.hang_report()
            if hung is not None:
                return TensorParallelError(hung)
            dead = [(r, p) for r, p in enumerate(self.procs, 1) if not p.is_alive()]
            killed = [(r, p) for r, p in dead if (p.exitcode or 0) < 0]
            if killed:  # a signal ended it: it left no report, the others' are about losing it
                return _died(*killed[0])
            reports = {r: self.store.get(k).decode() for r, k in keys.items() if self.store.check([k])}
            own = [r for r, text in reports.items() if not _lost_a_peer(text)]
            if own:
                return TensorParallelError(f"tensor-parallel rank {own[0]} failed: {reports[own[0]]}")
            if (dead or reports) and since is None:
                since = time.monotonic()
            if since is not None and time.monotonic() - since > 0.5:  # no other cause showed up
                if reports:
                    rank = min(reports)
                    return TensorParallelError(f"tensor-parallel rank {rank} failed: {reports[rank]}")
                return _died(*dead[0])
            time.sleep(0.05)
        if not self.procs:  # torchrun: the ranks are not our children
            return TensorParallelError(f"tensor-parallel collective failed (a rank exited or is unreachable): {exc}")
        return exc

    def shutdown(self) -> None:
        """Stop every worker: "stop" when the group is healthy, then terminate, then kill; then close rank 0's
        collectives (collectives.py, Exit) when "stop" reached every rank. After a healthy run a worker that ended
        on its own other than with exit code 0 (e.g. SIGABRT at exit: heartbeat.py and collectives.py, Exit) is
        named in a RuntimeWarning and `unclean_exit`: its work was done, but the process did not exit cleanly."""
        if self.closed:
            return
        self.closed = True
        if self.watchdog is not None:  # first, so that workers leaving are never taken for hung
            self.watchdog.stop()
        stopped = False  # "stop" reached every rank: no collective is left pending
        if self.failure is None and self.comm is not None:
            try:
                self.comm.broadcast_object(("stop",))
                stopped = True
            except RuntimeError:  # a dead or abandoned peer: the broadcast may still be pending in gloo
                pass
        deadline = time.monotonic() + (STOP_WAIT_S if self.failure is None else 0.5)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        exited = {r: p.exitcode for r, p in enumerate(self.procs, 1) if not p.is_alive()}  # on their own
        for p in self.procs:
            if p.is_alive() and self.failure is None:
                p.terminate()
                p.join(2.0)
            if p.is_alive():  # SIGKILL: also ends a stopped process (SIGTERM waits for SIGCONT)
                p.kill()
                p.join()
        if stopped:  # "stop" was the last collective: gloo's threads joined now (collectives.py Exit)
            self.comm.close()
        elif self.comm is not None:  # freeing it could wait for an abandoned collective's timeout
            self._failed_comm = self.comm
        self.comm = None
        unclean = sorted(r for r, code in exited.items() if code != 0)
        if self.failure is None and unclean:
            # named, not raised: every result was already delivered (an abort at the worker's interpreter exit:
            # heartbeat.py and collectives.py, Exit; raising here failed a finished run)
            rank = unclean[0]
            self.unclean_exit = (
                f"tensor-parallel rank {rank} did not exit cleanly after stop ({_exit_reason(exited[rank])})"
            )
            warnings.warn(self.unclean_exit + _last_words(self.procs[rank - 1]), RuntimeWarning, stacklevel=2)


def _last_words(proc) -> str:
    """The tail of a dead worker's stderr, for the error (its reason when it died before it could
    leave a report: an import or start-up failure)."""
    tail = proc.stderr_tail().strip() if hasattr(proc, "stderr_tail") else ""
    return f"; its stderr ends:\n{tail}" if tail else ""


def _died(rank: int, proc) -> TensorParallelError:
    return TensorParallelError(f"tensor-parallel rank {rank} died ({_exit_reason(proc.exitcode)}){_last_words(proc)}")


def _lost_a_peer(report: str) -> bool:
    """A rank's report of a collective whose peer went away (gloo's transport error: "Connection reset by
    peer", "Connection closed by peer"): a consequence of another rank's failure, not a cause."""
    return "gloo/transport" in report


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def holdings(echo: dict) -> dict:
    """A rank's experts per MoE layer, their bytes, the checkpoint bytes its load read and its peak RSS."""
    keys = ("routed_experts", "file_bytes_read", "peak_rss_bytes")
    return {"rank": echo["rank"], **{k: echo[k] for k in keys}}


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: each step runs on every rank; logits and route records come back here."""

    def __init__(self, loaded: LoadedModel, group: TensorParallelGroup, tracer=None) -> None:
        super().__init__(loaded.model, loaded.config, tracer, rank=0)
        self.group = group
        par = loaded.config.parallel
        # expert parallel: every rank computes the whole vocabulary's logits (replicated lm_head): nothing to gather
        self.vocab_sizes = logits_sizes(
            loaded.config.model.vocab_size, par.tensor_parallel_size, par.expert_parallel_size
        )
        self.rank_echoes: list[dict] = []
        self.last_hidden: torch.Tensor | None = None
        if self.drafter is not None:  # each MTP pass on every rank (speculative decoding, module docstring)
            self.drafter = TensorParallelDrafter(self.drafter, self)

    def execute_with_hidden(
        self, chunks: list[SeqChunk], preempted: tuple = (), ledger=None
    ) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor]:
        """A step on every rank (ModelRunner.execute goes through here): -> (batch, the whole vocabulary's
        logits, rank 0's hidden states [T, D], which every rank holds the same)."""
        return self.group.guard(self._execute_all, chunks, preempted, ledger)

    def _execute_all(self, chunks: list[SeqChunk], preempted: tuple, ledger) -> tuple:
        comm = self.group.comm
        comm.broadcast_object(("step", chunks, preempted, self.tracer.enabled))
        received = getattr(self.model, "expert_received", None)
        before = received.snapshot() if received is not None else None
        tap, fields = _tap(ledger)
        batch, local, hidden = super().execute_with_hidden(chunks, preempted, tap)
        self.last_hidden = hidden  # the rows an MTP pass may read next (TensorParallelDrafter)
        logits = comm.gather_logits(local, self.vocab_sizes) if self.vocab_sizes is not None else local
        if self.tracer.enabled:
            recs = comm.gather_objects(None)[1:]
            for rec in recs:
                self.tracer.record(rec | fields)  # a verify step's fields are rank 0's: one view
            if received is not None:  # expert parallel: every rank's received pairs of this step, side by side
                self.tracer.record(expert_load(self.step_count - 1, received.since(before), recs, "trunk"))
        return batch, logits, hidden

    def rollback(self, kept: dict[str, int]) -> None:
        """A verify step's rejected drafts put back on every rank (DeepSeek-V4 under expert parallelism: each
        rank keeps its own copy of the request states); only after a step that kept a tape, which every rank
        kept (the same chunks)."""
        if self.tape is not None:
            self.group.guard(self.group.comm.broadcast_object, ("rollback", kept))
        super().rollback(kept)

    def check_configs(self) -> None:
        """Gather every rank's echo; a rank whose effective configuration differs is an error."""
        mine = rank_echo(0, self.cfg, self.model)
        self.rank_echoes = self.group.comm.gather_objects(mine)
        for echo in self.rank_echoes[1:]:
            diff = [k for k in mine["config"] if echo["config"].get(k) != mine["config"][k]]
            if diff:
                lines = "; ".join(
                    f"{k}: rank 0 {mine['config'][k]}, rank {echo['rank']} {echo['config'].get(k)}" for k in diff
                )
                raise ConfigError(f"tensor-parallel rank {echo['rank']} runs a different configuration: {lines}")
        if self.tracer.enabled and self.cfg.parallel.expert_parallel_size > 1:
            # expert parallel: the ledger's first record says which rank holds which experts and what each read
            self.tracer.record({"expert_holdings": [holdings(echo) for echo in self.rank_echoes]})

    def close(self) -> None:
        self.group.shutdown()


def expert_load(step: int, mine: dict, recs: list[dict], phase: str) -> dict:
    """The ledger's expert_load record of one forward pass: rank 0's received pairs (`mine`) and every worker's
    (its record's `experts_received`), side by side; `pass`: "trunk" (a step's decoder layers) or "mtp" (an MTP
    pass: the MTP layer's MoE; the record also carries the pass's `draft_depth`)."""
    load = [{"rank": 0, **mine}] + [{"rank": r["rank"], **r["experts_received"]} for r in recs]
    return {"step": step, "pass": phase, "expert_load": load}


def _tap(ledger):
    """(a ledger callable that also keeps what it returned, that dict): rank 0's fields for every rank's record."""
    fields: dict = {}
    if ledger is None:
        return None, fields

    def tap(batch, route) -> dict:
        fields.update(ledger(batch, route))
        return fields

    return tap, fields


class TensorParallelDrafter:
    """Rank 0's drafter under tensor and / or expert parallelism: each MTP pass runs on every rank (its slice of
    the MTP layer, or its range of the MTP layer's experts; its all-reduces), the logits' vocabulary slices
    gathered here (under expert parallelism alone every rank has the whole vocabulary: nothing to gather),
    where the engine picks the drafts. hold / end_draft run on every rank (DeepSeek-V4's drafter keeps its
    rings there; nothing on the MLA families' drafter)."""

    def __init__(self, local, runner: TensorParallelRunner) -> None:
        self.local, self.runner = local, runner
        self.last_g: torch.Tensor | None = None  # the last pass's output, which every rank holds the same

    @property
    def tracer(self):
        return self.local.tracer

    @tracer.setter
    def tracer(self, tracer) -> None:
        self.local.tracer = tracer

    def hold(self, slots: list[int]) -> None:
        self.runner.group.guard(self.runner.group.comm.broadcast_object, ("hold", slots))
        self.local.hold(slots)

    def end_draft(self) -> None:
        self.runner.group.guard(self.runner.group.comm.broadcast_object, ("end_draft",))
        self.local.end_draft()

    def forward(self, chunks: list[SeqChunk], hidden: torch.Tensor, rows: dict[str, int], step_no: int, ledger=None):
        return self.runner.group.guard(self._forward_all, chunks, hidden, rows, step_no, ledger)

    def _forward_all(self, chunks, hidden, rows, step_no, ledger):
        comm, runner = self.runner.group.comm, self.runner
        if hidden is self.last_g:
            source = "draft"
        elif hidden is runner.last_hidden:
            source = "trunk"
        else:  # rows only rank 0 kept (a paused request's trunk rows): the rows this pass reads, sent
            hidden, rows = rows_read(chunks, hidden, rows)
            source = hidden
        trace = self.local.tracer.enabled
        comm.broadcast_object(("draft", chunks, rows, step_no, source, trace))
        received = getattr(runner.model, "expert_received", None)
        before = received.snapshot() if received is not None else None
        tap, fields = _tap(ledger)
        batch, local, g = self.local.forward(chunks, hidden, rows, step_no, tap)
        self.last_g = g
        logits = comm.gather_logits(local, runner.vocab_sizes) if runner.vocab_sizes is not None else local
        if trace:
            recs = comm.gather_objects(None)[1:]
            for rec in recs:
                self.local.tracer.record(rec | fields)  # the pass's depth: rank 0's fields, one view
            if received is not None:  # expert parallel: the MTP layer's pairs of this pass, every rank's
                load = expert_load(step_no, received.since(before), recs, "mtp")
                self.local.tracer.record(load | {"draft_depth": fields.get("draft_depth")})
        return batch, logits, g


def rows_read(chunks: list[SeqChunk], hidden: torch.Tensor, rows: dict[str, int]):
    """The rows of hidden an MTP pass over chunks reads (each chunk's query_len rows from rows[request_id]),
    packed in chunk order -> (packed [R, D], each request's first row in it)."""
    parts, packed = [], {}
    for c in chunks:
        packed[c.request_id] = sum(p.shape[0] for p in parts)
        parts.append(hidden[rows[c.request_id] : rows[c.request_id] + len(c.token_ids)])
    return torch.cat(parts), packed


def start_tensor_parallel(path, opts: EngineOptions, tracer, progress=None, rank_overrides=None):
    """-> (LoadedModel of rank 0's slice, TensorParallelRunner) with every rank loaded and its
    configuration checked. Split errors (heads not divisible by N) come before any process starts.
    Under torchrun (its environment names the rendezvous) the other ranks are torchrun's processes
    running `serve_torchrun_rank`; otherwise this process starts them."""
    from mlaserve.distributed.launch import torchrun_rendezvous

    ck = open_checkpoint(path, opts)
    world = opts.tensor_parallel_size * opts.expert_parallel_size
    joined = torchrun_rendezvous(world)
    if joined is not None:
        group = TensorParallelGroup.join(joined[0], world)
    else:
        group = TensorParallelGroup.start(str(path), opts, rank_overrides)
    loaded = group.guard(fill_model, ck, progress, group.comm)
    runner = TensorParallelRunner(loaded, group, tracer)
    torch.set_num_threads(loaded.config.runtime.threads)  # as every worker did, before echoing it
    group.guard(runner.check_configs)
    return loaded, runner


__all__ = ["TensorParallelError", "TensorParallelGroup", "TensorParallelRunner", "effective_config"]
