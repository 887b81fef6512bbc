"""This directory runs vLLM 0.33.0's real Scheduler, so it needs real torch and vLLM.

The package's CI (scripts/test.sh) collects runtime/python/tests with a conftest that stubs
torch and vLLM's heavy modules; there, nothing here is collected. scripts/connector.sh runs
this directory in the vLLM test harness's venv (with --confcutdir, so that stubbing conftest
is never loaded).
"""

import importlib
import sys


def _real_torch() -> bool:
    try:
        torch = sys.modules.get("torch") or importlib.import_module("torch")
    except ImportError:
        return False
    # The CI conftest's stub modules have no __file__.
    return getattr(torch, "__file__", None) is not None


if not _real_torch():
    collect_ignore_glob = ["*.py"]
