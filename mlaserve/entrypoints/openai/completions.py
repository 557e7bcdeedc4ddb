"""POST /v1/completions: text or token-id prompts (or a batch), n samples, echo, logprobs, stream.

`echo` with `max_tokens: 0` scores the prompt: the engine request asks for prompt logprobs and
one token (the engine always samples one), which is dropped. This is how lm-eval's
`local-completions` asks for log-likelihoods (it sends max_tokens 1 and drops the last entry).
"""

from __future__ import annotations

import time
from dataclasses import replace

from mlaserve.entrypoints.openai.constraints import sampling_extras
from mlaserve.entrypoints.openai.errors import APIError
from mlaserve.entrypoints.openai.protocol import CompletionRequest
from mlaserve.entrypoints.openai.serving import Job, OpenAIServing, SubRequest, choice_error, new_id, sse_chunk


def build_job(serving: OpenAIServing, req: CompletionRequest) -> tuple[Job, list]:
    serving.check_model(req.model)
    if req.max_tokens == 0 and not req.echo:
        raise APIError(
            400, "max_tokens must be >= 1 (0 only with echo, to score the prompt)", "max_tokens", "invalid_value"
        )
    scoring = req.echo and req.max_tokens == 0
    extras = sampling_extras(serving, req, req.n)
    job_id = new_id("cmpl")
    subs, params = [], []
    for i, (ids, text) in enumerate(serving.completion_prompts(req)):
        max_tokens = serving.max_tokens(1 if scoring else req.max_tokens, len(ids), "max_tokens")
        prompt_lp = req.logprobs if (req.echo and req.logprobs is not None) else None
        sp = serving.sampling(req, max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_lp, **extras)
        echo_text = (text if text is not None else serving.decode(ids)) if req.echo else None
        for j in range(req.n):
            idx = i * req.n + j
            subs.append(SubRequest(idx, f"{job_id}-{i}-{j}", ids, echo_text, scoring))
            params.append(replace(sp, seed=None if sp.seed is None else sp.seed + j))
    return Job(job_id, subs), params


def logprobs_block(serving: OpenAIServing, ids: list[int], entries: list, n: int, offset: int) -> dict:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs (top n), text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(ids, entries):
        s = serving.token_str(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(serving.decode([tid]))  # a special token (<bos>) is not in the returned text
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(entry.get(tid))
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:n]
        tops.append({serving.token_str(t): v for t, v in best})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _generated(sub: SubRequest, final) -> tuple[str, list[int], list]:
    c = final.outputs[0]
    if sub.scoring:
        return "", [], []
    entries = (c.logprobs or [])[: len(c.token_ids)]  # the entry of an EOS that ended it has no token
    return c.text, list(c.token_ids), entries


def choice(serving: OpenAIServing, req: CompletionRequest, sub: SubRequest) -> dict:
    final = sub.final
    text, ids, entries = _generated(sub, final)
    lp = None
    if req.logprobs is not None:
        all_ids, all_entries, head = ids, entries, ""
        if req.echo:
            all_ids = sub.prompt_ids + ids
            all_entries = list(final.prompt_logprobs or [None] * len(sub.prompt_ids)) + entries
        lp = logprobs_block(serving, all_ids, all_entries, req.logprobs, len(head))
    reason = "length" if sub.scoring and not sub.error else final.outputs[0].finish_reason
    out = {"index": sub.index, "text": (sub.echo_text or "") + text, "logprobs": lp, "finish_reason": reason}
    if sub.error:
        out["error"] = choice_error(sub)
    return out


def usage(job: Job) -> dict:
    seen, prompt, cached = set(), 0, 0
    for s in job.subs:
        key = s.rid.rsplit("-", 1)[0]  # n samples of one prompt count the prompt once
        if key not in seen:
            seen.add(key)
            prompt += len(s.prompt_ids)
            out = s.final or s.last  # prompt tokens served from the prefix cache (that sample's)
            cached += out.metrics.get("num_cached_prompt_tokens", 0) if out is not None else 0
    done = sum(0 if s.scoring else len(s.final.outputs[0].token_ids) for s in job.subs if s.final is not None)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": done,
        "total_tokens": prompt + done,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def response(serving: OpenAIServing, req: CompletionRequest, job: Job) -> dict:
    return {
        "id": job.id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": serving.served_name,
        "choices": [choice(serving, req, s) for s in sorted(job.subs, key=lambda s: s.index)],
        "usage": usage(job),
    }


def stream_delta(serving: OpenAIServing, req: CompletionRequest, job: Job, sub: SubRequest, out) -> str | None:
    """The SSE chunk for what this output adds to the sub-request (None when nothing new)."""
    c = out.outputs[0]
    if not out.finished and len(c.token_ids) == sub.sent_tokens and len(c.text) == sub.sent_text:
        return None  # a prefill chunk, or a token whose text is held back (UTF-8, stop strings)
    first, sub.started = not sub.started, True
    text = "" if sub.scoring else c.text[sub.sent_text :]
    ids = [] if sub.scoring else list(c.token_ids[sub.sent_tokens :])
    lp = None
    if req.logprobs is not None:
        entries = (c.logprobs or [])[sub.sent_tokens : sub.sent_tokens + len(ids)]
        if req.echo and first:
            prompt_entries = list(out.prompt_logprobs or [None] * len(sub.prompt_ids))
            lp = logprobs_block(serving, sub.prompt_ids + ids, prompt_entries + entries, req.logprobs, 0)
        else:
            lp = logprobs_block(serving, ids, entries, req.logprobs, 0)
    if first and sub.echo_text:
        text = sub.echo_text + text
    if not sub.scoring:
        sub.sent_text, sub.sent_tokens = len(c.text), len(c.token_ids)
    reason = ("length" if sub.scoring and not sub.error else c.finish_reason) if out.finished else None
    if not text and not ids and reason is None and not (first and req.echo):
        return None
    ch = {"index": sub.index, "text": text, "logprobs": lp, "finish_reason": reason}
    if sub.error:
        ch["error"] = choice_error(sub)
    return sse_chunk(serving, job, "text_completion", [ch])


async def stream(serving: OpenAIServing, req: CompletionRequest, job: Job, raw_request):
    async for sub, out in serving.outputs(job, raw_request):
        chunk = stream_delta(serving, req, job, sub, out)
        if chunk is not None:
            yield chunk
    serving.raise_if_all_failed(job)  # nothing was produced: an error event, then [DONE]
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse_chunk(serving, job, "text_completion", [], usage(job))
    yield "data: [DONE]\n\n"
