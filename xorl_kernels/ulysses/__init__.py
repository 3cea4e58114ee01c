"""Ulysses all-to-all pack / unpack: op.py (dispatch), csrc.py (the extension's wrappers),
layout.py (the layouts, shape checks), reference.py (plain torch)."""
