"""The toy world: procedurally drawn scenes, their texts and benchmarks, a toy CLIP, and the CPU quickstart.

A package beside ``demind`` that depends on it, never the reverse. Modules: ``world`` (scenes,
seeds, edits), ``render`` / ``decor`` (pixels), ``texts``, ``intent_data`` (toy intent shards),
``benchmarks`` (toy CIRR, ImageNet-R, COCO, exclusion, ExclCOCO), ``probes``, ``towers`` (the
convnet registered with timm; a ``demind.plugins`` entry point), ``clip`` / ``clip_data`` /
``clip_train`` / ``clip_eval`` / ``clip_cache`` (the toy CLIP), ``pipeline`` / ``results`` (the
quickstart) and ``cli`` (``demind-quickstart``).
"""
