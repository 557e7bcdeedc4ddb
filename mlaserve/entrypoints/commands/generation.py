"""`mlaserve generate`: prompts streamed to the terminal, with the sampling defaults of the model's
generation_config.json and a speed line per prompt."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from mlaserve.entrypoints.commands.progress import progress_bar
from mlaserve.entrypoints.engine_args import add_engine_args, make_llm
from mlaserve.sampling.params import SamplingParams


def add(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text for one or more prompts, streamed to the terminal",
        description='Generate a continuation for each PROMPT. Example: mlaserve generate "Hello"',
    )
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    add_engine_args(p)
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy; default: the model's generation_config.json (else greedy)",
    )
    p.add_argument("--top-p", type=float, default=None, help="default: the model's generation_config.json (else 1)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (default 0: no limit)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed, for repeatable samples (default: none)")
    p.set_defaults(func=run)


def run(args) -> int:
    # The ledger file is appended to: its summary covers this run's records only.
    start = Path(args.trace).stat().st_size if args.trace and Path(args.trace).exists() else 0
    # The flags the user gave are checked before the (slow) load; the model's defaults after it.
    SamplingParams(**_user_sampling(args, temperature=0.0, top_p=1.0))
    llm = make_llm(args, progress_bar)
    params = SamplingParams(**_user_sampling(args, **_sampling_defaults(args, llm.loaded.generation_config)))
    with warnings.catch_warnings():  # the engine's notes (e.g. the context limit) as one plain line
        warnings.showwarning = _print_note
        for prompt in args.prompts:
            text = prompt
            if args.chat:
                text = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            _stream(llm, llm.encode(text), params, prompt)
    if args.trace:
        from mlaserve.observability.expert_load import summarize_expert_load
        from mlaserve.observability.summary import format_summary, read_ledger, summarize

        llm.runner.tracer.close()
        records = read_ledger(args.trace, start)
        print(format_summary(summarize(records), summarize_expert_load(records)), file=sys.stderr)
    return 0


def _print_note(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"\nmlaserve: note: {message}", file=sys.stderr)


def _user_sampling(args, temperature: float, top_p: float) -> dict:
    return dict(
        temperature=args.temperature if args.temperature is not None else temperature,
        top_p=args.top_p if args.top_p is not None else top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )


def _sampling_defaults(args, gen: dict) -> dict:
    """Options the user left unset come from the model's generation_config.json, as in vLLM/transformers;
    the note says where each value came from."""
    sampled = bool(gen.get("do_sample"))
    values, sources = {}, []
    for name, flag, fallback in (("temperature", "--temperature", 0.0), ("top_p", "--top-p", 1.0)):
        given = getattr(args, name)
        if given is not None:
            values[name], src = given, flag
        elif sampled and name in gen:
            values[name], src = gen[name], "generation_config.json"
        else:
            values[name] = fallback if name == "top_p" or not sampled else 1.0
            src = "default" if not sampled else "default (generation_config.json sets do_sample)"
        sources.append(f"{name} {values[name]} ({src})")
    if sampled and args.temperature is None:
        print(f"sampling: {', '.join(sources)}; --temperature 0 for greedy", file=sys.stderr)
    return values


def _stream(llm, ids: list[int], params: SamplingParams, shown: str) -> None:
    engine = llm.engine
    rid = engine.add_request(ids, params)
    sys.stdout.write(shown)
    printed = 0
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                text = out.outputs[0].text
                sys.stdout.write(text[printed:])
                sys.stdout.flush()
                printed = len(text)
                final = out
                if out.finished and out.outputs[0].error:
                    print(f"\nmlaserve: request failed: {out.outputs[0].error}", file=sys.stderr)
    sys.stdout.write("\n")
    if final is not None:
        print(speed_line(final), file=sys.stderr)


def speed_line(out) -> str:
    """Prompt and generated token counts with their rates (like llama.cpp's timings line)."""
    m, n_out = out.metrics, len(out.outputs[0].token_ids)
    ttft = m.get("time_to_first_token")
    line = f"[{len(out.prompt_token_ids)} prompt tokens"
    if ttft:
        line += f" in {ttft:.2f} s ({len(out.prompt_token_ids) / ttft:.1f} tok/s)"
    line += f"; {n_out} generated"
    if "tokens_per_s" in m:
        line += f", {m['tokens_per_s']:.1f} tok/s after the first"
    if "acceptance_rate" in m:  # speculative decoding (--speculative mtp)
        line += (
            f"; MTP drafts {m['num_accepted_tokens']}/{m['num_draft_tokens']} accepted "
            f"({m['acceptance_rate']:.0%}), mean accepted length {m['mean_accepted_length']:.2f}"
        )
    if "num_spec_paused_steps" in m:  # the acceptance switch paused its drafting
        line += f"; drafting paused {m['num_spec_paused_steps']} steps ({m['num_spec_probes']} probes)"
    return line + f"; finish: {out.outputs[0].finish_reason}]"
