"""The toy world's commands: ``demind-quickstart`` (:mod:`.quickstart`) and ``demind-toy-clip`` (:mod:`.toy_clip`)."""
