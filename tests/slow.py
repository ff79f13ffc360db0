"""The mark of slow tests (a real nginx, the smg gateway, server restarts
and kills): they run only when asked for, as .ci/run does:

    PYSERVE_SLOW_TESTS=1 python -m pytest -m slow
"""

from __future__ import annotations

import os

import pytest

slow = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("PYSERVE_SLOW_TESTS") != "1",
                       reason="slow: run with PYSERVE_SLOW_TESTS=1 python -m pytest -m slow"),
]


def slow_test(test):
    """`slow` on one test function."""
    for mark in slow:
        test = mark(test)
    return test
