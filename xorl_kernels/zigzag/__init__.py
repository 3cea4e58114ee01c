"""Zig-zag context-parallel gather / scatter: op.py (dispatch, autograd), csrc.py (the extension's
wrapper), reference.py (the layout, zigzag_positions, plain torch)."""
