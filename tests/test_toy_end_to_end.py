"""The quickstart's default run learns what the method should: De-MINDS beats Image-only
and Text-only on the toy CIRR benchmark by a clear margin.

Slow (11-14 minutes on a 2-core CPU; 682 s measured: it trains the toy CLIP and De-MINDS from nothing),
so it is off by default: ``pytest -m slow tests/test_toy_end_to_end.py``.

The margin: over seeds 0, 1, 2 the default run gave De-MINDS toy-CIRR R@5 35.2 +- 1.0
(per seed 34.5 / 36.3 / 34.7) and R@10 51.4 +- 1.4 against Image-only 22.5 / 33.0 and
Text-only 7.3 / 14.5 (BENCHMARKS.md): the smallest gap, R@5 over Image-only, was 12.0 to
13.8 points per seed. A margin of 8 points is 4 seed standard deviations below the mean
gap, and still 4 standard errors of a 600-query recall (sqrt(0.5 * 0.5 / 600) = 2 points).
"""

from __future__ import annotations

import pytest

from demind.toy.pipeline import QuickstartConfig, run_quickstart

MARGIN = 8.0  # recall points


@pytest.mark.slow
def test_default_quickstart_beats_image_only_and_text_only(tmp_path):
    summary = run_quickstart(QuickstartConfig(workdir=str(tmp_path / "qs"), seeds=[0], progress=False))
    rows = summary["rows"]
    for metric in ("cirr:R@5", "cirr:R@10"):
        demind = rows["demind"]["metrics"][metric][0]
        for baseline in ("image-only", "text-only"):
            other = rows[baseline]["metrics"][metric][0]
            assert demind > other + MARGIN, (metric, baseline, demind, other)
