"""POST /v1/chat/completions: messages through the chat template, n samples, logprobs, stream.

Template: --chat-template FILE, else the model folder's chat_template, else the plain transcript
"role: content" lines followed by "assistant:" (engine/tokenizer.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from mlaserve.entrypoints.openai.completions import usage
from mlaserve.entrypoints.openai.constraints import sampling_extras
from mlaserve.entrypoints.openai.errors import APIError
from mlaserve.entrypoints.openai.protocol import ChatCompletionRequest
from mlaserve.entrypoints.openai.reasoning import ReasoningSplitter, prompt_start
from mlaserve.entrypoints.openai.serving import Job, OpenAIServing, SubRequest, choice_error, new_id, sse_chunk
from mlaserve.entrypoints.openai.tool_calls import thinks, tool_context

log = logging.getLogger("mlaserve.server")


def build_job(serving: OpenAIServing, req: ChatCompletionRequest) -> tuple[Job, list]:
    serving.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    ids = serving.chat_prompt(req)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = serving.max_tokens(requested, len(ids), name, "messages")
    n_lp = (req.top_logprobs or 0) if req.logprobs else None
    extras = sampling_extras(serving, req, req.n)
    # a thinking template: reasoning first (the prompt opened <think>, or the model may open it), then content
    start = prompt_start(serving, ids, thinks(serving))
    splitter = ReasoningSplitter(start.mode == "inside") if thinks(serving) else None
    ctx = tool_context(serving, req)  # tools: the grammar of the model's tool-call format
    if ctx is not None:
        extras["structured"] = ctx.structured
    spec = extras["structured"]
    if spec is not None and start.mode != "off":  # the grammar starts where the reasoning ends
        field = "tools" if ctx is not None else "response_format" if req.response_format else "structured_outputs"
        try:
            extras["structured"] = replace(spec, after_reasoning=start.mode)
            serving.llm.engine.check_params_structured(extras["structured"])
        except ValueError as e:
            raise APIError(400, f"{field}: {e}", field, "invalid_value") from None
    sp = serving.sampling(req, max_tokens, logprobs=n_lp, **extras)
    job_id = new_id("chatcmpl")
    subs = [SubRequest(j, f"{job_id}-0-{j}", ids) for j in range(req.n)]
    params = [replace(sp, seed=None if sp.seed is None else sp.seed + j) for j in range(req.n)]
    job = Job(job_id, subs)
    job.tool_ctx, job.reasoning = ctx, splitter
    if spec is not None and thinks(serving):  # the decision, recorded with the request
        log.info("%s grammar after reasoning: %s (%s)", job_id, start.mode, start.why)
    return job, params


def logprobs_content(serving: OpenAIServing, ids: list[int], entries: list, n: int) -> list[dict]:
    out = []
    for tid, entry in zip(ids, entries):
        s = serving.token_str(tid)
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:n]
        out.append(
            {
                "token": s,
                "logprob": entry.get(tid),
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [
                    {"token": serving.token_str(t), "logprob": v, "bytes": list(serving.token_str(t).encode())}
                    for t, v in best
                ],
            }
        )
    return out


def _logprobs(serving, req, ids, entries):
    if not req.logprobs:
        return None
    return {"content": logprobs_content(serving, ids, entries, req.top_logprobs or 0)}


def response(serving: OpenAIServing, req: ChatCompletionRequest, job: Job) -> dict:
    choices = []
    for sub in sorted(job.subs, key=lambda s: s.index):
        c = sub.final.outputs[0]
        entries = (c.logprobs or [])[: len(c.token_ids)]
        reasoning, text = None, c.text
        if getattr(job, "reasoning", None) is not None:
            reasoning, text = job.reasoning.split(c.text)
        message, reason = {"role": "assistant", "content": text}, c.finish_reason
        ctx = getattr(job, "tool_ctx", None)
        if ctx is not None:
            message, reason = ctx.message(text, c.finish_reason)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        choices.append(
            {
                "index": sub.index,
                "message": message,
                "logprobs": _logprobs(serving, req, list(c.token_ids), entries),
                "finish_reason": reason,
            }
        )
        if sub.error:
            choices[-1]["error"] = choice_error(sub)
    return {
        "id": job.id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": serving.served_name,
        "choices": choices,
        "usage": usage(job),
    }


def stream_delta(serving: OpenAIServing, req: ChatCompletionRequest, job: Job, sub: SubRequest, out) -> str | None:
    c = out.outputs[0]
    if not out.finished and len(c.token_ids) == sub.sent_tokens and len(c.text) == sub.sent_text:
        return None  # a prefill chunk, or a token whose text is held back (UTF-8, stop strings)
    ids = list(c.token_ids[sub.sent_tokens :])
    entries = (c.logprobs or [])[sub.sent_tokens : sub.sent_tokens + len(ids)]
    delta = {"content": c.text[sub.sent_text :]}
    reason = c.finish_reason if out.finished else None
    text, splitter, think = c.text, getattr(job, "reasoning", None), {}
    if splitter is not None:  # reasoning as it comes; content from what follows </think>
        reasoning, text = splitter.stream(sub.index, c.text, out.finished)
        sent = splitter.sent.setdefault(("content", sub.index), 0)
        delta = {"content": text[sent:]}
        splitter.sent[("content", sub.index)] = max(sent, len(text))
        if reasoning:
            think = {"reasoning_content": reasoning}
    ctx = getattr(job, "tool_ctx", None)
    if ctx is not None:  # content once it cannot start a call; each call whole when its section is complete
        content, calls, reason = ctx.stream(sub.index, text, out.finished, reason)
        delta = {"content": content}
        if calls:
            delta["tool_calls"] = calls
    delta.update(think)
    if not sub.started:
        delta["role"] = "assistant"
    sub.started = True
    sub.sent_text, sub.sent_tokens = len(c.text), len(c.token_ids)
    ch = {
        "index": sub.index,
        "delta": delta,
        "logprobs": _logprobs(serving, req, ids, entries),
        "finish_reason": reason,
    }
    if sub.error:
        ch["error"] = choice_error(sub)
    return sse_chunk(serving, job, "chat.completion.chunk", [ch])


async def stream(serving: OpenAIServing, req: ChatCompletionRequest, job: Job, raw_request):
    async for sub, out in serving.outputs(job, raw_request):
        chunk = stream_delta(serving, req, job, sub, out)
        if chunk is not None:
            yield chunk
    serving.raise_if_all_failed(job)  # nothing was produced: an error event, then [DONE]
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse_chunk(serving, job, "chat.completion.chunk", [], usage(job))
    yield "data: [DONE]\n\n"
