"""Optional adapters that run other libraries' QSA layers through numqsa.

Each adapter imports its library lazily: ``import numqsa`` never imports torch or transformers.
"""
