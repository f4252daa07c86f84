"""The ground floor: errors, constants, the checkpoint-metadata record, process-group helpers and run records.

Every other package of pardec may import from here; nothing here imports any other pardec package
(``tests/test_layers.py`` checks the whole import graph). Layers, from the ground up::

    common  ->  masks, losses  ->  data_pipelines  ->  models  ->  methods, inference  ->  trainers
            ->  scripts, benchmarks
"""
