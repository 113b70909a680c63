"""Worker of ``test_launch.py``: records its pid and those of two processes it starts outside its own tree, then
hangs (or, with ``--exit``, exits 0 at once).

``python hang_worker.py --out DIR [--exit]`` writes ``DIR/pids{rank}``, one pid per line: this worker, a child in
a session of its own (as a data-loader or compile worker may be), and a daemon started by a double fork (a new
session, re-parented to PID 1 when its parent exits), which holds the log pipe. Both sleep far past any test
timeout: the launcher has to kill them, whether the launch times out or ends.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def start_daemon() -> int:
    """Double fork: the intermediate process starts a new session, forks the daemon and exits; returns the daemon's
    pid. The daemon keeps this process's stdout and stderr (the launcher's log pipe)."""
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:
            time.sleep(3600)
            os._exit(0)
        os.write(w, str(pid).encode())
        os._exit(0)
    os.close(w)
    pid = int(os.read(r, 32))
    os.close(r)
    os.wait()  # the intermediate process
    return pid


parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--exit", action="store_true", help="exit 0 once the pids are written instead of hanging")
args = parser.parse_args()
rank = os.environ.get("RANK", "0")
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
daemon = start_daemon()
tmp = Path(args.out) / f"pids{rank}.tmp"
tmp.write_text(f"{os.getpid()}\n{child.pid}\n{daemon}\n")
tmp.rename(Path(args.out) / f"pids{rank}")
if not args.exit:
    time.sleep(3600)
