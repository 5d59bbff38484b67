"""The trained add-ons: draft heads, EAGLE draft layers, DuoAttention gates and candidate trees, their maths and their file formats."""
