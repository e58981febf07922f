"""The command line: the only package under ``demind/`` that parses arguments or reads the environment.

Each module parses its command's arguments, calls the library, prints the outcome, and has
``main(argv=None) -> int``; :func:`demind.cli.common.run_command` turns a known error into
one ``error: ...`` line and exit status 2 (``--debug`` or ``DEMIND_DEBUG=1`` adds the traceback).

=====================  ==============================  ===================================
console script         also runs as                    module
=====================  ==============================  ===================================
``demind-train``       ``python train.py``              :mod:`demind.cli.train`
``demind-features``    ``python -m demind.features``    :mod:`demind.cli.features`
``demind-eval``        ``python -m demind.eval``        :mod:`demind.cli.evaluate`
``demind-generate``    ``python data_gen/run.py``       :mod:`demind.cli.generate`
``demind-make-shards`` ``python data_gen/make_shards.py`` :mod:`demind.cli.make_shards`
(none)                 ``python data_gen/make_tiny_model.py`` :mod:`demind.cli.make_tiny_model`
``demind-quickstart``  ``python pipelines/quickstart.py`` :mod:`demind.cli.quickstart`
=====================  ==============================  ===================================
"""
