"""The fast tier (`pytest -m "not slow"`, tests/conftest.py) leaves out what its list names: every
pattern of SLOW_FILES matches a test file, so a renamed file cannot slip back into the fast tier
while its entry silently matches nothing."""
from conftest import SLOW_FILES, TESTS


def test_every_slow_pattern_names_a_test_file():
    unmatched = [pattern for pattern in SLOW_FILES if not list(TESTS.glob(pattern))]
    assert not unmatched, f"tests/conftest.py SLOW_FILES names no file: {unmatched}"
