"""scripts/replay.py: every shipped spec's emitted outputs (derivation, torch module, Triton
module) equal their golden copies, and the replay reports a changed or missing copy as a
diff naming the file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "scripts" / "replay.py"
spec = importlib.util.spec_from_file_location("replay", PATH)
replay = importlib.util.module_from_spec(spec)
sys.modules["replay"] = replay
spec.loader.exec_module(replay)


def test_every_shipped_spec_emits_its_golden_copies():
    paths = replay.shipped_specs()
    assert len(paths) >= 30  # specs/, specs/examples/, specs/probes/
    diffs = replay.replay(paths, list(replay.OUTPUTS)) + replay.stale(paths, list(replay.OUTPUTS))
    assert diffs == [], (
        "the emitted text changed; review the diff and run "
        "`.venv/bin/python scripts/replay.py --update`:\n" + "\n".join(diffs)[:4000]
    )


@pytest.fixture
def golden_copies(tmp_path, monkeypatch):
    """The replay's golden folders redirected to a scratch copy of deltanet's."""
    path = replay.ROOT / "specs" / "deltanet.yaml"
    outputs = {}
    for name, (emit, folder, suffix) in replay.OUTPUTS.items():
        scratch = tmp_path / folder.relative_to(replay.GOLDEN)
        outputs[name] = (emit, scratch, suffix)
    monkeypatch.setattr(replay, "OUTPUTS", outputs)
    return path


def test_a_missing_or_changed_copy_is_a_diff_and_update_writes_it(golden_copies):
    path = golden_copies
    (missing,) = replay.replay([path], ["torch"])
    assert "torch/deltanet.py.golden (missing)" in missing
    assert replay.replay([path], ["torch", "derivation"], update=True) == []
    assert replay.replay([path], ["torch", "derivation"]) == []
    golden = replay.golden_of("torch", "deltanet")
    golden.write_text(golden.read_text().replace("def ", "def  ", 1))
    (changed,) = replay.replay([path], ["torch", "derivation"])
    assert changed.startswith("---") and "-def  " in changed and "+def " in changed


def test_a_copy_without_its_spec_is_stale(golden_copies):
    path = golden_copies
    replay.replay([path], ["derivation"], update=True)
    _, folder, suffix = replay.OUTPUTS["derivation"]
    (folder / f"renamed{suffix}").write_text("old\n")
    (found,) = replay.stale([path], ["derivation"])
    assert "renamed.txt.golden: no shipped spec named it" in found
