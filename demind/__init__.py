"""demind: zero-shot composed image retrieval that understands manipulation intent.

The library: frozen CLIP backbone (``demind.backbone``), the De-MINDS model
(``demind.model``), losses, checkpoints, configs, data, feature cache, training,
evaluation and data generation (``demind.gen``). The synthetic toy world behind the CPU
quickstart is a separate package beside it, ``toyworld``, which depends on demind.
"""

__version__ = "0.1.0"
