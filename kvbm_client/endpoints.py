"""Where the daemons listen: unix sockets (mode 0600 in a 0700 directory) by default,
TCP when an address is given as host:port."""
from __future__ import annotations

import os
import stat


def is_unix(address: str) -> bool:
    return address.startswith("unix:")


def unix_path(address: str) -> str:
    path = address[len("unix:"):]
    return path[2:] if path.startswith("//") else path


def prepare_unix_socket(address: str) -> str:
    """Create the socket's directory (0700) and remove a stale socket file; returns the path."""
    path = unix_path(address)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        os.unlink(path)
    return path


def secure_unix_socket(address: str) -> None:
    os.chmod(unix_path(address), 0o600)


def remove_unix_socket(address: str) -> None:
    if is_unix(address):
        try:
            os.unlink(unix_path(address))
        except FileNotFoundError:
            pass
