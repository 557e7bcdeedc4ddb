"""A step whose layer kinds differ (DeepSeek-V4: window and HCA layers beside CSA layers, which alone select
rows) is summarised per segment: only the CSA segments count as sparse, the others as dense."""

from __future__ import annotations

from mlaserve.observability.summary import summarize


def _segment(path: str, sparse: bool, n: int, phase: str = "prefill") -> dict:
    return {"phase": phase, "path": path, "sparse": sparse, "num_tokens": n, "backend": "torch"}


def _step(segments: list[dict], needs_selection: bool) -> dict:
    return {
        "step": 0,
        "num_tokens": segments[0]["num_tokens"],
        "num_decode_tokens": 0,
        "sparse": True,  # the step as a whole: some layer selected
        "needs_selection": needs_selection,
        "effective_topk": 3,
        "segments": segments,
        "requests": [{"id": "r", "cached_tokens": 0}],
    }


def _route(rec: dict) -> dict:
    s = summarize([rec])[None].to_json()
    return {(r["phase"], r["path"], r["mode"]): r["tokens"] for r in s["tokens_by_route"]}


def test_each_segment_counts_in_its_own_mode():
    segs = [_segment("window", False, 16), _segment("window+csa", True, 16), _segment("window+hca", False, 16)]
    assert _route(_step(segs, needs_selection=True)) == {
        ("prefill", "window", "dense"): 16,
        ("prefill", "window+csa", "sparse top-k"): 16,
        ("prefill", "window+hca", "dense"): 16,
    }
    assert _route(_step(segs, needs_selection=False))[("prefill", "window+csa", "sparse all rows")] == 16


def test_a_segment_without_its_own_mode_takes_the_steps():
    segs = [{k: v for k, v in _segment("absorbed", False, 4, "decode").items() if k != "sparse"}]
    assert _route(_step(segs, needs_selection=True)) == {("decode", "absorbed", "sparse top-k"): 4}
