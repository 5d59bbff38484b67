"""The IR: graph module + model info, shapes, printer, verifier, dumps."""
