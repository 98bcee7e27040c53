"""Watchdog of one ``workbench server start``: ``python server_watchdog.py PGID RUNTIME_DIR``.

Standard library only, run as a script. Its stdin is the read end of a pipe whose write
end only the launcher holds; the read returns when the launcher exits, however it exits
(SIGKILL included). Then the server's process group gets SIGTERM, SIGKILL after a grace
period, and the runtime folder with the server's secret files is removed.
"""

import os
import shutil
import signal
import sys
import time

GRACE_SECONDS = 5.0


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(pgid: int) -> None:
    for sig, wait in ((signal.SIGTERM, GRACE_SECONDS), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not group_alive(pgid):
                return
            time.sleep(0.1)


def main() -> None:
    pgid, folder = int(sys.argv[1]), sys.argv[2]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe decides
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        while sys.stdin.buffer.read(4096):
            pass
    finally:
        stop_group(pgid)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
