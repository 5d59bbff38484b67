"""Reference maths that the op schema, the drafts and the runtime share: attention (``sdpa``), its mask (``mask``) and 4-bit weights (``int4``)."""
