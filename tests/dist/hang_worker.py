"""Worker of ``test_launch.py``: records its pid (and that of a child it starts) and then hangs.

``python hang_worker.py --out DIR`` writes ``DIR/pids{rank}`` (this worker and its grandchild, one per line)
and sleeps far past any test timeout; the launcher's timeout has to kill it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()
rank = os.environ.get("RANK", "0")
# a grandchild in its own session, as a data-loader or compile worker may be: the launcher must find it too
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
tmp = Path(args.out) / f"pids{rank}.tmp"
tmp.write_text(f"{os.getpid()}\n{child.pid}\n")
tmp.rename(Path(args.out) / f"pids{rank}")
time.sleep(3600)
