"""The Python API: ``trace()``, ``optimize()`` and the evaluation of a pipeline against the unoptimized model."""
