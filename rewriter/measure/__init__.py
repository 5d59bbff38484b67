"""What passes measure and choose by, free of the runtime: the cost models of rounds and
skip sets (their timings come from a ``Measurer``, ``rewriter.ir.pass_manager``), attention
recall, host reads, the machine's name."""
