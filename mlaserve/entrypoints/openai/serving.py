"""The serving logic behind the HTTP routes: OpenAI request -> token ids + SamplingParams ->
requests on the engine loop -> OpenAI responses (whole, or as server-sent-event chunks).

One HTTP request becomes len(prompts) x n engine requests ("<id>-<prompt>-<sample>"); seeded
samples j get seed + j (as LLM.generate does). Every engine request goes through the loop's
add / abort; outputs come back on an asyncio queue per HTTP request. A client that goes away
aborts its engine requests (their pages are freed at once).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mlaserve.engine.engine_loop import EngineLoop, StepFailure
from mlaserve.engine.request import RequestOutput
from mlaserve.entrypoints.openai.errors import APIError, from_value_error
from mlaserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from mlaserve.observability.metrics import ServerMetrics
from mlaserve.sampling.params import SamplingParams

log = logging.getLogger("mlaserve.server")
DISCONNECT_POLL_S = 0.25


@dataclass
class SubRequest:
    """One engine request of an HTTP request: prompt i, sample j."""

    index: int
    rid: str
    prompt_ids: list[int]
    echo_text: str | None = None  # the prompt text returned first when echo
    scoring: bool = False  # echo with max_tokens=0: the generated token is dropped
    final: RequestOutput | None = None
    sent_text: int = 0  # characters already streamed
    sent_tokens: int = 0
    started: bool = False  # the first chunk (role / echoed prompt) went out
    error: str | None = None  # the engine failed this one: its choice ends with finish_reason "error"
    last: RequestOutput | None = None  # the latest output seen (what was produced, if it never finished)


@dataclass
class Job:
    """The engine requests of one HTTP request and the queue their outputs arrive on."""

    id: str
    subs: list[SubRequest]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    released: bool = False

    @property
    def done(self) -> bool:
        return all(s.final is not None for s in self.subs)


class OpenAIServing:
    def __init__(self, llm, loop: EngineLoop, metrics: ServerMetrics, served_name: str, max_in_flight: int) -> None:
        self.llm, self.loop, self.metrics = llm, loop, metrics
        self.tokenizer = llm.tokenizer
        self.served_name = served_name
        self.max_in_flight = max_in_flight  # engine requests admitted at once (running + queued)
        self.in_flight = 0
        self.max_model_len = llm.engine.max_model_len
        self.gen_defaults = llm.loaded.generation_config or {}
        self.chat_template: str | None = None  # --chat-template; else the tokenizer's (else fallback)
        self.cut_at: float | None = None  # shutting down: responses still running then end with a 503

    def cut_off_at(self, seconds: float) -> None:
        """Shutdown began: requests still running after `seconds` end with a 503 (a stream: an error
        event, then [DONE]) instead of being cut without a word."""
        self.cut_at = time.monotonic() + seconds

    # ------------------------------------------------------------------ input

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.served_name!r}",
                "model",
                "model_not_found",
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", "prompt", "no_tokenizer")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if self.tokenizer else ""

    def token_str(self, tid: int) -> str:
        return self.decode([tid], skip_special_tokens=False)

    def completion_prompts(self, req: CompletionRequest) -> list[tuple[list[int], str | None]]:
        """-> [(ids, text or None)] for a text, an id list, or a batch of either."""
        p = req.prompt
        items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        out = []
        for item in items:
            if isinstance(item, str):
                out.append((self.encode(item), item))
            else:
                out.append((list(item), None))
        vocab = self.llm.config.model.vocab_size
        for ids, _ in out:
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} outside the vocabulary [0, {vocab})", "prompt", "invalid_value")
            if not ids:
                raise APIError(400, "prompt encodes to no tokens", "prompt", "invalid_value")
        return out

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: chat needs one", "messages", "no_tokenizer")
        from mlaserve.entrypoints.openai.tool_calls import prompt_messages

        msgs, template_kwargs = prompt_messages(self, req)  # tool calls, tool results, tools, template kwargs
        tok = self.tokenizer
        saved = tok.chat_template
        try:
            if self.chat_template is not None:
                tok.chat_template = self.chat_template
            text = tok.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt, **template_kwargs)
        except Exception as e:  # a template that raises on these messages is the request's problem
            raise APIError(400, f"chat template failed on these messages: {e}", "messages", "invalid_value") from e
        finally:
            tok.chat_template = saved
        bos = tok.config.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        ids = self.encode(text, add_special_tokens=not (bos and text.startswith(bos)))
        if not ids:
            raise APIError(400, "messages render to an empty prompt", "messages", "invalid_value")
        return ids

    def max_tokens(self, requested: int | None, prompt_len: int, field_name: str, prompt_field: str = "prompt") -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise APIError(
                400,
                f"prompt of {prompt_len} tokens does not fit the context ({self.max_model_len} tokens, one left to generate)",
                prompt_field,
                "context_length_exceeded",
            )
        if requested is None:
            return room
        if requested > room:
            raise APIError(
                400,
                f"{field_name} {requested} + prompt {prompt_len} tokens exceed the context of {self.max_model_len} tokens",
                field_name,
                "context_length_exceeded",
            )
        return requested

    def sampling(self, req: SamplingFields, max_tokens: int, **extra) -> SamplingParams:
        g = self.gen_defaults
        sampled = bool(g.get("do_sample", True))

        def pick(value, key, default):
            return value if value is not None else (g.get(key, default) if sampled else default)

        try:
            return SamplingParams(
                temperature=pick(req.temperature, "temperature", 1.0),
                top_p=pick(req.top_p, "top_p", 1.0),
                top_k=pick(req.top_k, "top_k", 0),
                min_p=req.min_p if req.min_p is not None else 0.0,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                seed=req.seed,
                max_tokens=max_tokens,
                stop=req.stop,
                ignore_eos=req.ignore_eos,
                skip_special_tokens=req.skip_special_tokens,
                **extra,
            )
        except ValueError as e:
            raise from_value_error(e) from e

    # ------------------------------------------------------------------ engine requests

    def admit(self, count: int, param: str | None = None) -> None:
        if count > self.max_in_flight:  # could never fit: a retry cannot help
            raise APIError(
                400,
                f"this request needs {count} engine requests (prompts x n), over the server's limit of "
                f"{self.max_in_flight} in flight (--max-num-seqs + --max-queued): split it",
                param,
                "too_many_choices",
            )
        if self.in_flight + count > self.max_in_flight:
            raise APIError(
                429,
                f"server busy: {self.in_flight} requests in flight (limit {self.max_in_flight}); retry later",
                None,
                "too_many_requests",
                {"Retry-After": "1"},
            )
        if not self.loop.alive:
            raise APIError(503, "the engine loop is not running", None, "engine_dead")

    async def submit(self, job: Job, params: list[SamplingParams], prompt_field: str) -> None:
        """Add every sub-request on the engine loop; a rejected one aborts those already added."""
        aloop = asyncio.get_running_loop()

        def sink(out, q=job.queue):
            aloop.call_soon_threadsafe(q.put_nowait, out)

        prompts = len({s.rid.rsplit("-", 1)[0] for s in job.subs})
        self.admit(len(job.subs), "n" if prompts == 1 else prompt_field)
        self.in_flight += len(job.subs)
        added = []
        try:
            for sub, sp in zip(job.subs, params):
                await asyncio.wrap_future(self.loop.add(sub.prompt_ids, sp, sub.rid, sink))
                added.append(sub.rid)
        except ValueError as e:
            for rid in added:
                self.loop.abort(rid)
            self.in_flight -= len(job.subs)
            raise from_value_error(e, prompt_field) from e
        except BaseException:
            for rid in added:
                self.loop.abort(rid)
            self.in_flight -= len(job.subs)
            raise

    def release(self, job: Job) -> None:
        """The HTTP request is over (finished, failed or gone): abort what is still live. Idempotent."""
        if job.released:
            return
        job.released = True
        for sub in job.subs:
            if sub.final is None:
                self.loop.abort(sub.rid)
        self.in_flight -= len(job.subs)

    async def outputs(self, job: Job, raw_request) -> AsyncIterator[tuple[SubRequest, RequestOutput]]:
        """Each output of the job's engine requests as it arrives, and stops (aborting) when the client
        is gone. A sub-request the engine failed comes back with finish_reason "error" and `sub.error`
        set; the others go on (`all_failed` says whether anything was produced)."""
        by_rid = {s.rid: s for s in job.subs}
        last_check = time.monotonic()
        while not job.done:
            try:
                item = await asyncio.wait_for(job.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                item = None
            if raw_request is not None and time.monotonic() - last_check >= DISCONNECT_POLL_S:
                last_check = time.monotonic()
                if await raw_request.is_disconnected():
                    raise ClientGone(job.id)
            if self.cut_at is not None and time.monotonic() >= self.cut_at:
                raise APIError(503, "the server is shutting down (its grace period ran out)", None, "shutting_down")
            if item is None:
                continue
            sub = by_rid[item.request_id]
            if isinstance(item, StepFailure):
                item, why = _failed(item), item.reason
            else:
                why = (getattr(item.outputs[0], "error", None) or "finish_reason error") if item.finished else None
            sub.last = item
            if item.finished:
                sub.final = item
                if item.outputs[0].finish_reason == "error":
                    sub.error = f"the engine failed this request: {why}"
                    log.error("%s failed in the engine: %s", item.request_id, why)
            yield sub, item

    @staticmethod
    def raise_if_all_failed(job: Job) -> None:
        """500 when the engine failed every choice of the request (nothing to return)."""
        if job.subs and all(s.error for s in job.subs):
            raise APIError(500, job.subs[0].error, None, "engine_error")

    def log_done(self, job: Job, status: int, kind: str) -> None:
        finals = [s.final for s in job.subs if s.final is not None]
        seen = [s.final or s.last for s in job.subs if (s.final or s.last) is not None]  # aborted: what came
        prompt = sum(len(s.prompt_ids) for s in job.subs)
        output = sum(
            len((s.final or s.last).outputs[0].token_ids) for s in job.subs if (s.final or s.last) and not s.scoring
        )
        ttfts = [f.metrics.get("time_to_first_token") for f in seen if f.metrics.get("time_to_first_token")]
        ttft = min(ttfts) if ttfts else None
        rates = [f.metrics["tokens_per_s"] for f in finals if f.metrics.get("tokens_per_s")]
        timing = {
            "ttft": ttft,
            "tpot": (sum(1 / r for r in rates) / len(rates)) if rates else None,
            "e2e": time.monotonic() - job.arrival,
            "cached_tokens": sum(f.metrics.get("num_cached_prompt_tokens", 0) for f in seen),
        }
        self.metrics.on_finished(status, prompt, output, timing)
        reasons = ",".join(sorted({str(f.outputs[0].finish_reason) for f in finals})) or "-"
        log.info(
            "%s %s status=%d prompt_tokens=%d output_tokens=%d ttft=%s finish=%s",
            job.id,
            kind,
            status,
            prompt,
            output,
            f"{ttft * 1000:.1f}ms" if ttft is not None else "-",
            reasons,
        )


class ClientGone(Exception):
    """The client disconnected; its engine requests are aborted."""


def _failed(f: StepFailure) -> RequestOutput:
    from mlaserve.engine.request import CompletionOutput

    return RequestOutput(f.request_id, None, [], [CompletionOutput(0, "", [], "error")], True)


def choice_error(sub: SubRequest) -> dict:
    """The `error` object of a choice the engine failed (its finish_reason is "error")."""
    return {"message": sub.error, "type": "server_error", "param": None, "code": "engine_error"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def sse_chunk(serving: OpenAIServing, job: Job, obj: str, choices: list, usage: dict | None = None) -> str:
    """One server-sent event of a stream (obj: "text_completion" or "chat.completion.chunk")."""
    body = {"id": job.id, "object": obj, "created": int(time.time()), "model": serving.served_name, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"
