"""The pool suite: worker processes (the reliability suite's helpers) and in-process ones."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reliability"))
