"""The mark of slow tests (a real nginx, the smg gateway): they run only
when asked for, as .ci/run does:

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
