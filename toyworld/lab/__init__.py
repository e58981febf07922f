"""The toy world's research probes: scripts that measure the toy world itself (its toy CLIP, its toy
CIRR's calibration, training recipes on it), run by hand while designing it, with their readings in
``docs/lab-notes/``. Each is ``python -m toyworld.lab.NAME`` with a ``main(argv) -> int``.

These are command-line tools, so they parse their own arguments (the layout tests allow argparse
here and in ``toyworld/cli/``); nothing in the toy world or the library imports them.

* :mod:`toyworld.lab.cirr_calibrate` — the toy CIRR's three untrained baselines for one design.
* :mod:`toyworld.lab.clip_seeds` — the toy CLIP trained with several seeds: its pair probes, mean ± std.
* :mod:`toyworld.lab.mllm_family` — the query-time MLLM family with the toy MLLM, per noise level.
* :mod:`toyworld.lab.pair_probes` — pair probes of a saved toy CLIP, by style, objects and theme.
* :mod:`toyworld.lab.query_geometry` — where trained queries sit relative to the modality gap.
* :mod:`toyworld.lab.recipes` — De-MINDS training recipes through the quickstart, paired.
"""
