"""The quickstart's default run (World v2, the tag-pretrained, locked convnet toy CLIP with a
2-layer text tower) is an instrument: its backbone sees what the pair probes ask for, and De-MINDS
beats Image-only and Text-only on the toy CIRR benchmark by a clear margin.

Slow (about 15 minutes on a 2-core CPU: it trains the toy CLIP, not taking its shipped weights, and
De-MINDS from nothing), so it is off by default: ``pytest -m slow tests/toyworld/test_end_to_end.py``.

The probe bar the toy CLIP must clear: shape, colour, background, style >= 90, size >= 85 (chance 50).
On World v2.1 (painted sculptures) the default recipe, seed 0, measured shape 92.8, colour 96.3,
size 86.2, background 97.5, style 96.7 in the fresh-clone quickstart with 2 threads (training is
deterministic for a thread count, not across thread counts). Size sits 1.2 points over its bar;
over the toy CLIP's seeds see docs/quickstart.md. Before v2.1, colour missed (88.5): a sculpture drew
its objects in stone grey while the texts named their colours.

The margin over Image-only and Text-only (12 recall points) is justified in ``MARGIN``'s comment
from the runs in docs/quickstart.md.
"""

from __future__ import annotations

import pytest

from toyworld.clip_config import ToyBackboneConfig
from toyworld.pipeline import QuickstartConfig, ToyRunConfig, run_quickstart

# recall points. Over De-MINDS seeds 0, 1, 2 on World v2.1 (docs/quickstart.md, "The earlier instrument:
# toy CIRR cirr-1") the smallest lead over Image-only was 20.7 (R@5 53.5
# against 32.8) and 21.8 at R@10, over Text-only 32.2. 12 stays 8 points under the worst seed (it was
# set on toy-world-2, whose worst lead was 15.2) and is still 5 standard errors of a 600-query recall
# difference (about 2.4 points).
MARGIN = 12.0
PROBE_BAR = {"shape": 90.0, "colour": 90.0, "background": 90.0, "style": 90.0, "size": 85.0}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    # the recipe is what is tested: trained here, not taken from the shipped weights
    return run_quickstart(QuickstartConfig(workdir=str(tmp_path_factory.mktemp("e2e") / "qs"), seeds=[0],
                                           backbone=ToyBackboneConfig(shipped=False),
                                           run=ToyRunConfig(progress=False)))


@pytest.mark.slow
def test_default_toy_clip_passes_the_pair_probe_bar(default_run):
    probes = default_run["backbone_probes"]
    for attribute, bar in PROBE_BAR.items():
        assert probes[attribute] >= bar, (attribute, probes)
    assert 0.0 <= probes["position"] <= 100.0  # measured and reported, no bar


@pytest.mark.slow
def test_default_quickstart_beats_image_only_and_text_only(default_run):
    rows = default_run["rows"]
    for metric in ("cirr:R@5", "cirr:R@10"):
        demind = rows["demind"]["metrics"][metric][0]
        for baseline in ("image-only", "text-only"):
            other = rows[baseline]["metrics"][metric][0]
            assert demind > other + MARGIN, (metric, baseline, demind, other)
