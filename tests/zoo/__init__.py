"""The registry sweep: attncomp on a tiny random-weight model of every family that the installed
transformers registers for causal LM, masked LM, sequence-to-sequence LM and image classification.

``python -m tests.zoo`` (``make zoo``) runs every family in its own subprocess and writes
``tests/zoo/results.json`` and ``tests/zoo/RESULTS.md``; ``tests/zoo/test_zoo_sample.py`` runs a fixed
sample of families through the same check (:func:`tests.zoo.check.check`) in the test suite.
"""
