"""Ulysses all-to-all pack / unpack: op.py (dispatch), csrc.py (the extension's wrappers),
reference.py (layouts, checks, plain torch)."""
