"""Triton backend (fusion grouping, kernel templates, generated kernels): not built yet."""
