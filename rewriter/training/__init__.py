"""The training commands: draft heads, EAGLE draft layers, DuoAttention gates, and the loop and memory helpers they share."""
