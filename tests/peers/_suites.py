"""Where the peers' contract suites are.

The originals live in the project's shared folder, beside this checkout
(``../shared/peers/adk``, ``../shared/peers/langgraph``): ``make peers`` runs them from
there when they are present. A clone made elsewhere (a clean CI clone) runs the copies kept
under ``peers/``, which ``test_vendored.py`` keeps equal to the originals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]
SHARED: dict[str, Path] = {
    "adk": ROOT.parent / "shared/peers/adk",
    "langgraph": ROOT.parent / "shared/peers/langgraph",
}


def suite(name: Literal["adk", "langgraph"]) -> Path:
    """The folder of suite ``name``: the shared original when present, else the copy."""
    shared = SHARED[name]
    return shared if shared.is_dir() else ROOT / "peers" / name
