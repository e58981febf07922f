"""The quickstart's default run learns what the method should: De-MINDS beats Image-only
and Text-only on the toy CIRR benchmark by a clear margin.

Slow (about 15-17 minutes on a 2-core CPU: it trains the toy CLIP and De-MINDS from nothing),
so it is off by default: ``pytest -m slow tests/test_toy_end_to_end.py``.

The margin: over seeds 0, 1, 2 the default run gave De-MINDS toy-CIRR R@10 52.1 +- 0.6
(R@5 37.1 +- 0.8) against Image-only 33.2 (22.0) and Text-only 13.3 (7.8), BENCHMARKS.md.
A 10-point margin is over 15 seed standard deviations below the observed gap to Image-only,
and still about 5 standard errors of a 600-query recall (sqrt(0.5 * 0.5 / 600) = 2 points).
"""

from __future__ import annotations

import pytest

from demind.toy.pipeline import QuickstartConfig, run_quickstart

MARGIN = 10.0  # recall points


@pytest.mark.slow
def test_default_quickstart_beats_image_only_and_text_only(tmp_path):
    summary = run_quickstart(QuickstartConfig(workdir=str(tmp_path / "qs"), seeds=[0], progress=False))
    rows = summary["rows"]
    for metric in ("cirr:R@5", "cirr:R@10"):
        demind = rows["demind"]["metrics"][metric][0]
        for baseline in ("image-only", "text-only"):
            other = rows[baseline]["metrics"][metric][0]
            assert demind > other + MARGIN, (metric, baseline, demind, other)
