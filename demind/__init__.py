"""demind: zero-shot composed image retrieval that understands manipulation intent.

The library: frozen CLIP backbone (``demind.backbone``), the De-MINDS model
(``demind.model``), losses, checkpoints, configs, data, feature cache, training,
evaluation, data generation (``demind.gen``) and a synthetic toy world (``demind.toy``).
"""

__version__ = "0.1.0"
