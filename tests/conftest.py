"""Settings for the whole test session."""

import os

# The compilation progress lines (embedcore/compile_progress.py) would interleave with pytest's output and with
# the stderr that tests read from processes they start; the reporter's own tests turn them on.
os.environ.setdefault("EMBEDCORE_PROGRESS", "0")
