"""The runtime: lowering (``lower``, ``programs``), the KV cache as data (``kv_cache``),
steps and attention over the cache (``attention``), decoding strategies (``generate``:
one token a step; ``speculative``: draft and verify), sampling and its settings, chat
templates, the ``Engine`` that ties them together, and artifacts."""
