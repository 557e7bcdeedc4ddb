"""No import circle even counting the imports made for annotations only (`if TYPE_CHECKING:` blocks): such a
circle never runs, but it says two modules each need the other's names, and the design rule is one way. Where a
lower module must name a higher one's type, it states the fields it reads as a Protocol
(config/mla_reader/checks.py BuiltConfig), or the shared piece moves down (attention/pooled_metadata.py holds the
pools' geometry that models/pooled_indexer.py and the router read)."""

from __future__ import annotations

from test_import_graph import ROOT, circles, import_graph


def test_the_package_has_no_circles_counting_annotations():
    graph = import_graph(ROOT, "mlaserve", annotations=True)
    assert len(graph) > 150 and sum(map(len, graph.values())) > 400  # the whole package was read
    assert circles(graph) == []


def test_annotations_count_only_when_asked(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    files = {
        "__init__.py": "",
        "a.py": "from pkg.b import x\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\nx = 1\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert circles(import_graph(tmp_path, "pkg")) == []
    assert circles(import_graph(tmp_path, "pkg", annotations=True)) == [["pkg.a", "pkg.b"]]
