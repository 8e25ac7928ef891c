"""peers/ holds copies of the project's shared contract suites: they match the originals."""

from __future__ import annotations

import pytest

from tests.peers._suites import ROOT, SHARED


@pytest.mark.parametrize("suite", ["adk", "langgraph"])
def test_the_copy_matches_the_shared_suite(suite: str) -> None:
    original = SHARED[suite]
    if not original.is_dir():
        pytest.skip(f"{original} is not on this machine: nothing to compare the copy with")
    copy = ROOT / "peers" / suite
    names = sorted(p.name for p in original.iterdir() if p.is_file())
    assert names == sorted(p.name for p in copy.iterdir() if p.is_file())
    for name in names:
        assert (copy / name).read_bytes() == (original / name).read_bytes(), name
