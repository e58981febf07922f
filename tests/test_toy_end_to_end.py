"""The quickstart's default run (World v2, the toy CLIP with the 2-layer text tower) is an
instrument: its backbone sees what the pair probes ask for, and De-MINDS beats Image-only and
Text-only on the toy CIRR benchmark by a clear margin.

Slow (about 14 minutes on a 2-core CPU: it trains the toy CLIP and De-MINDS from nothing), so it
is off by default: ``pytest -m slow tests/test_toy_end_to_end.py``.

The probe bar is issue 20's: shape, colour, background, style >= 90, size >= 85 (chance 50).
The default recipe meets it on colour, size, background and style (v2 seed 0, one thread: 92.5 /
88.0 / 100.0 / 99.2; a fresh-clone quickstart with 2 threads: 91.0 / 86.8 / 99.5 / 98.5; training
is not bit-identical across thread counts) and not on shape (64.8 / 62.5), which is marked as an
expected failure (strict: it will say so when a recipe reaches 90). Colour and size sit within
2 points of their bars.

The margin: on World v2 over seeds 0, 1, 2 with the previous toy CLIP (4-layer text; BENCHMARKS.md)
De-MINDS led Image-only by at least 17.0 recall points (R@10: 52.8 +- 0.9 against 31.5), and
Text-only by more; the default's fresh-clone run (seed 0) leads by 17.0 (R@5: 40.5 against 23.5)
and 22.8 (R@10: 53.3 against 30.5). A margin of 12 points is well below both, and still 6
standard errors of a 600-query recall (sqrt(0.5 * 0.5 / 600) = 2 points).
"""

from __future__ import annotations

import pytest

from demind.toy.pipeline import QuickstartConfig, run_quickstart

MARGIN = 12.0  # recall points
PROBE_BAR = {"colour": 90.0, "background": 90.0, "style": 90.0, "size": 85.0}
SHAPE_BAR = 90.0


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    return run_quickstart(QuickstartConfig(workdir=str(tmp_path_factory.mktemp("e2e") / "qs"), seeds=[0],
                                           progress=False))


@pytest.mark.slow
def test_default_toy_clip_passes_the_pair_probe_bar(default_run):
    probes = default_run["backbone_probes"]
    for attribute, bar in PROBE_BAR.items():
        assert probes[attribute] >= bar, (attribute, probes)
    assert 0.0 <= probes["position"] <= 100.0  # measured and reported, no bar


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="issue 20: the toy CLIP sees shape at ~63-65 of 100, short of the 90 bar")
def test_default_toy_clip_sees_shape(default_run):
    assert default_run["backbone_probes"]["shape"] >= SHAPE_BAR


@pytest.mark.slow
def test_default_quickstart_beats_image_only_and_text_only(default_run):
    rows = default_run["rows"]
    for metric in ("cirr:R@5", "cirr:R@10"):
        demind = rows["demind"]["metrics"][metric][0]
        for baseline in ("image-only", "text-only"):
            other = rows[baseline]["metrics"][metric][0]
            assert demind > other + MARGIN, (metric, baseline, demind, other)
