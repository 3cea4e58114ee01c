"""Zig-zag context-parallel gather / scatter: layout.py (the layout, zigzag_positions, argument
checks), op.py (dispatch, autograd), csrc.py (the extension's wrapper), reference.py (plain torch)."""
