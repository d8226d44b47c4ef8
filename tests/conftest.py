"""Test-wide setup. Keep it tiny."""

import os

# Triton reads this at import; CPU test runs use its interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
