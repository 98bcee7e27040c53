"""Google Drive: ``mount`` makes ``<mountpoint>/MyDrive`` a plain local folder (the test reads it back)."""

from __future__ import annotations

import os


def mount(mountpoint: str, force_remount: bool = False) -> None:
    os.makedirs(os.path.join(mountpoint, "MyDrive"), exist_ok=True)
    print(f"Mounted at {mountpoint}")
