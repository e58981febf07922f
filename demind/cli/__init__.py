"""The command line: the only package under ``demind/`` that parses arguments or reads the environment.

Each command module parses its command's arguments, calls the library, prints the outcome, and has
``main(argv=None) -> int``; :func:`demind.cli.common.run_config_command` turns a known error into
one ``error: ...`` line and exit status 2 (``--debug`` or ``DEMIND_DEBUG=1`` adds the traceback).

Commands (console script; the script or ``python -m`` form that calls the same ``main``):

* :mod:`demind.cli.train` -- ``demind-train``; ``python train.py``, ``accelerate launch train.py``
* :mod:`demind.cli.features` -- ``demind-features``; ``python -m demind.features``
* :mod:`demind.cli.evaluate` -- ``demind-eval``; ``python -m demind.eval``
* :mod:`demind.cli.generate` -- ``demind-generate``; ``python data_gen/run.py``
* :mod:`demind.cli.generate_triplets` -- ``demind-generate-triplets``
* :mod:`demind.cli.make_shards` -- ``demind-make-shards``; ``python data_gen/make_shards.py``
* :mod:`demind.cli.make_tiny_model` -- ``demind-make-tiny-model``; ``python data_gen/make_tiny_model.py``
* :mod:`toyworld.cli.quickstart` -- ``demind-quickstart``; ``python pipelines/quickstart.py``
* :mod:`toyworld.cli.toy_clip` -- ``demind-toy-clip`` (trains the toy CLIP the package ships)
* :mod:`demind.cli.index` -- ``demind-index`` (a gallery index for search)
* :mod:`demind.cli.search` -- ``demind-search`` (composed queries against an index)
* :mod:`demind.cli.serve` -- ``demind-serve`` (the search web page)
* :mod:`demind.cli.build_exclcoco` -- ``demind-build-exclcoco``; ``python -m demind.cli.build_exclcoco``
* :mod:`demind.cli.train_exclmm` -- ``demind-train-exclmm``; ``python -m demind.cli.train_exclmm``
* :mod:`demind.cli.train_triplets` -- ``demind-train-triplets``; ``accelerate launch -m demind.cli.train_triplets``
* :mod:`demind.cli.mine_pairs` -- ``demind-mine-pairs`` (image pairs for generated triplets)
* :mod:`demind.cli.negation_report` -- ``demind-negation-report``; ``python -m demind.cli.negation_report``
* :mod:`demind.cli.publish` -- ``demind-publish`` (a checkpoint or shards as a Hugging Face Hub repository)
* :mod:`demind.cli.cc3m_list` -- ``demind-cc3m-list`` (CC3M's url list for img2dataset)

What several commands share lives beside them, not in one of them (no command imports another):
:mod:`demind.cli.common` (the config front end, ``--debug``, one line per known error) and
:mod:`demind.cli.model_options` (the models a command loads: checkpoint, backbone, MLLM).
"""
