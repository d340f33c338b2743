"""Shared by every test directory.

Tools that `make deps` unpacks into .build/tools/bin (promtool, out of Debian's prometheus
package, so that no prometheus service is ever installed) are put on PATH for the tests.
"""
from __future__ import annotations

import os
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / ".build" / "tools" / "bin"
if TOOLS.is_dir() and str(TOOLS) not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = f"{TOOLS}{os.pathsep}{os.environ.get('PATH', '')}"
