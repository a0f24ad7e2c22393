"""Where a daemon keeps its state, and where the CLI finds its Control socket; light,
so that every command can ask without importing the daemon."""

from __future__ import annotations

import os
from pathlib import Path

# Control's socket in the home, 0600: the CLI's default way to the daemon.
CONTROL_SOCKET = "control.sock"


def default_home() -> Path:
    env = os.environ.get("BLAZAR_HOME")
    if env:
        return Path(env).expanduser()
    # The XDG base directory specification: unset, empty or relative means the default.
    xdg = os.environ.get("XDG_DATA_HOME", "")
    data = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return data / "blazar"


def control_socket(home: Path) -> Path:
    return home / CONTROL_SOCKET


# Upstream Lanes' key files (`apiKeyFrom: file:NAME`), by name; nothing outside it is read.
KEYS_DIR = "keys"


def keys_dir(home: Path) -> Path:
    return home / KEYS_DIR
