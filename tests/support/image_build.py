"""deploy/image/build-offline.py as a module, for the tests that need crihook's wheel or image."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "image" / "build-offline.py"

_spec = importlib.util.spec_from_file_location("crihook_image_build", SCRIPT)
assert _spec is not None and _spec.loader is not None
offline = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = offline
_spec.loader.exec_module(offline)
