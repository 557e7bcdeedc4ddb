"""POST /v1/chat/completions: messages through the chat template, n samples, logprobs, stream.

Template: --chat-template FILE, else the model folder's chat_template, else the plain transcript
"role: content" lines followed by "assistant:" (engine/tokenizer.py).
"""

from __future__ import annotations

import time
from dataclasses import replace

from mlaserve.entrypoints.openai.completions import usage
from mlaserve.entrypoints.openai.errors import APIError
from mlaserve.entrypoints.openai.protocol import ChatCompletionRequest
from mlaserve.entrypoints.openai.serving import Job, OpenAIServing, SubRequest, choice_error, new_id, sse_chunk


def build_job(serving: OpenAIServing, req: ChatCompletionRequest) -> tuple[Job, list]:
    serving.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    ids = serving.chat_prompt(req)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = serving.max_tokens(requested, len(ids), name, "messages")
    n_lp = (req.top_logprobs or 0) if req.logprobs else None
    sp = serving.sampling(req, max_tokens, logprobs=n_lp)
    job_id = new_id("chatcmpl")
    subs = [SubRequest(j, f"{job_id}-0-{j}", ids) for j in range(req.n)]
    params = [replace(sp, seed=None if sp.seed is None else sp.seed + j) for j in range(req.n)]
    return Job(job_id, subs), params


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
        choices.append(
            {
                "index": sub.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": _logprobs(serving, req, list(c.token_ids), entries),
                "finish_reason": c.finish_reason,
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
    if not sub.started:
        delta["role"] = "assistant"
    sub.started = True
    sub.sent_text, sub.sent_tokens = len(c.text), len(c.token_ids)
    reason = c.finish_reason if out.finished else None
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
