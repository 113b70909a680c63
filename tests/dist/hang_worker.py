"""torchrun entry point that hangs: records its pid in ``DIR/pid{rank}`` and sleeps (tests/dist/test_launch.py)."""

import os
import sys
import time
from pathlib import Path

Path(sys.argv[1], f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
time.sleep(3600)
