"""The docs stay true to the code: docs/OPTIONS.md is what the generator renders from EngineOptions, and
every relative link (and anchor) in README.md and docs/*.md, and every repository path they name in
backticks, resolves."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from mlaserve.entrypoints import options_doc

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# A repository path in backticks: from the root (tests/x.py) or from the package (quant/ggml_layer.py).
REPO_PATH = re.compile(r"[A-Za-z_][\w.-]*(/[\w.-]+)+\.(py|c|md|png|sh|json)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces -> '-', repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_options_md_is_generated():
    path = ROOT / "docs" / "OPTIONS.md"
    assert path.exists(), f"docs/OPTIONS.md is missing; write it with: {options_doc.REGENERATE}"
    have, want = path.read_text(), options_doc.render()
    diff = "".join(
        list(difflib.unified_diff(have.splitlines(True), want.splitlines(True), "docs/OPTIONS.md", "render()"))[:12]
    )
    assert have == want, (
        f"docs/OPTIONS.md differs from EngineOptions (its defaults, help texts, vocabularies or flags); "
        f"regenerate it with: {options_doc.REGENERATE}\n{diff}"
    )


def test_options_md_names_every_option_and_flag():
    text = options_doc.render()
    from mlaserve.config.engine import EngineOptions

    for name in EngineOptions.__dataclass_fields__:
        assert f"| `{name}` |" in text
    # every flag the page names parses on the real command line
    flags = set(re.findall(r"`(--[a-z-]+)`", text))
    p = options_doc._parser()
    known = {s for a in p._actions for s in a.option_strings}
    assert flags and flags <= known, flags - known


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    bad = []
    for target in LINK.findall(CODE_SPAN.sub("", _prose(doc.read_text()))):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{doc.relative_to(ROOT)}: broken links: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(doc: Path):
    missing = [
        p
        for p in CODE_SPAN.findall(_prose(doc.read_text()))
        if REPO_PATH.fullmatch(p) and not (ROOT / p).exists() and not (ROOT / "mlaserve" / p).exists()
    ]
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


def test_the_checks_see_a_broken_link(tmp_path: Path):
    (tmp_path / "A.md").write_text("# Title\n## Sub `x`\n[ok](#sub-x) [bad](B.md) [bad anchor](#nope)\n")
    assert _anchors(tmp_path / "A.md") == {"title", "sub-x"}
    targets = LINK.findall((tmp_path / "A.md").read_text())
    assert targets == ["#sub-x", "B.md", "#nope"]
