"""The import graph of ``src/touba``: no circle between modules, no arrow against the layers.

The layers, from the top (a module may import only from its own layer's package or below):

- ``integrations | panel | cli``: independent of each other, except that ``cli`` imports
  ``panel`` (``touba panel`` serves it): the one import allowed between them.
- ``data``: a user's data over every store (erase, export, copy, retention), which the CLI
  and the panel call.
- ``memory``
- ``runtime | testing``: independent of each other; ``testing`` (the public test doubles:
  scripted provider, fake provider servers, store conformance) needs only providers and
  history, and nothing below ``cli`` imports it.
- ``providers``
- ``history``
- ``_encryption``: ``touba.Encryption``, the AES-GCM sealing every store may use.
- ``errors | _telemetry | _closing``: independent of each other (``_closing`` is the
  ``async with`` every store and session shares).

The graph comes from grimp (the library under import-linter), which reads every import
statement of a module, those under ``if TYPE_CHECKING:`` and inside functions included: an
import circle hidden in either still counts. grimp's layer check follows indirect chains as
well as direct imports. The circle check is the standard library's topological sort over
grimp's direct imports. Both checks are also run on a small package with a deliberate
circle and a deliberate upward import, so that a check that finds nothing cannot pass
unnoticed.
"""

from __future__ import annotations

import graphlib
from collections.abc import Sequence
from pathlib import Path

import grimp
import pytest

LAYERS: tuple[grimp.Layer, ...] = (
    grimp.Layer("integrations", "panel", "cli"),
    grimp.Layer("data"),
    grimp.Layer("memory"),
    grimp.Layer("runtime", "testing"),
    grimp.Layer("providers"),
    grimp.Layer("history"),
    grimp.Layer("_encryption"),
    grimp.Layer("errors", "_telemetry", "_closing"),
)
# Imports between packages of one level that exist today, stated as the rule.
ALLOWED_BETWEEN_SIBLINGS = frozenset({("touba.cli", "touba.panel")})


def _graph(package: str) -> grimp.ImportGraph:
    # No cache: a stale one could hide an import just added.
    return grimp.build_graph(package, cache_dir=None)


def circle(graph: grimp.ImportGraph) -> list[str] | None:
    """One import circle between the graph's modules (first module repeated last), or None."""
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    try:
        graphlib.TopologicalSorter(imports).prepare()
    except graphlib.CycleError as e:
        # graphlib lists each module before the one that imports it: reversed, it reads as
        # imports.
        found: list[str] = e.args[1]
        return found[::-1]
    return None


def against_layers(
    graph: grimp.ImportGraph,
    container: str,
    layers: Sequence[grimp.Layer],
    allowed: frozenset[tuple[str, str]] = frozenset(),
) -> list[str]:
    """Each import chain that runs up the layers (or across independent ones), as text."""
    found = graph.find_illegal_dependencies_for_layers(layers=layers, containers={container})
    lines = []
    for dependency in sorted(found, key=lambda d: (d.importer, d.imported)):
        if (dependency.importer, dependency.imported) in allowed:
            continue
        for route in dependency.routes:
            chain = " -> ".join((*route.heads, *route.middle, *route.tails))
            lines.append(f"{dependency.importer} imports {dependency.imported}: {chain}")
    return lines


@pytest.fixture(scope="module")
def touba_graph() -> grimp.ImportGraph:
    return _graph("touba")


def test_no_import_circle(touba_graph: grimp.ImportGraph) -> None:
    found = circle(touba_graph)
    assert found is None, (
        "import circle " + " -> ".join(found or []) + ": move the piece these modules "
        "share into a module of its own below them (STYLE.md)"
    )


def test_every_import_follows_the_layers(touba_graph: grimp.ImportGraph) -> None:
    wrong = against_layers(touba_graph, "touba", LAYERS, ALLOWED_BETWEEN_SIBLINGS)
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_the_allowed_sibling_import_is_still_needed(touba_graph: grimp.ImportGraph) -> None:
    # When cli stops importing panel, the exception goes too.
    for importer, imported in ALLOWED_BETWEEN_SIBLINGS:
        assert touba_graph.chain_exists(importer=importer, imported=imported)


def test_every_package_has_a_layer(touba_graph: grimp.ImportGraph) -> None:
    placed = {f"touba.{tail}" for layer in LAYERS for tail in layer.module_tails}
    unplaced = touba_graph.find_children("touba") - placed
    assert not unplaced, f"{sorted(unplaced)} have no layer: add them to LAYERS"


def _package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_find_a_circle_and_an_upward_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _package(
        tmp_path,
        {
            "layered/__init__.py": "",
            "layered/low/__init__.py": "",
            "layered/low/a.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from layered.low.b import B\n",
            "layered/low/b.py": "class B: ...\ndef f() -> None:\n    from layered.high import H\n",
            "layered/low/c.py": "def g() -> None:\n    from layered.low import a\n",
            "layered/high/__init__.py": "H = 1\n",
            "layered/low/d.py": "from layered.low.c import g\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = _graph("layered")
    layers = (grimp.Layer("high"), grimp.Layer("low"))
    assert circle(graph) is None  # c -> a (in a function) -> b: a chain, no circle

    _package(tmp_path, {"layered/low/b.py": "from layered.low.c import g\n"})
    graph = _graph("layered")
    found = circle(graph)
    assert found is not None
    assert set(found) == {"layered.low.a", "layered.low.b", "layered.low.c"}

    _package(tmp_path, {"layered/low/b.py": "def f() -> None:\n    from layered.high import H\n"})
    wrong = against_layers(_graph("layered"), "layered", layers)
    assert wrong == ["layered.low imports layered.high: layered.low.b -> layered.high"]
    allowed = frozenset({("layered.low", "layered.high")})
    assert against_layers(_graph("layered"), "layered", layers, allowed) == []
