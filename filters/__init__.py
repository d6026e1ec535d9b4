"""meshd's decision core: sans-I/O objects that parse, hash, score and decide.

Nothing here performs I/O or reads a clock; time is always an argument.
"""
