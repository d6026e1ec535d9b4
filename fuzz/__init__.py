"""Coverage-guided fuzzing (atheris, libFuzzer) of meshd's parsers and decoders.

Each target in `fuzz/targets/` takes raw bytes, runs the compiled twin and the pure-Python
twin (or, where a parser has no twin, the same bytes fed whole and split) and asserts they
agree and that nothing but the documented error escapes. `python -m fuzz` runs them;
`fuzz/corpus/<target>/` holds the seed corpora, which tests/test_fuzz.py also replays.
"""
