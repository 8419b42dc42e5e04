"""Where the daemons listen: unix sockets (mode 0600 in a private 0700 directory) by default,
TCP when an address is given as host:port.

Runs in every role. The socket directory is checked the way ssh-agent checks its own: it
must be a real directory (not a symlink), owned by us, with no permission for group or
others. A directory that fails the check is never used, by the daemons (which would expose
their sockets) or by clients (which would talk to whoever planted it).
"""
from __future__ import annotations

import os
import stat

from .errors import KvbmConfigError


def is_unix(address: str) -> bool:
    return address.startswith("unix:")


def unix_path(address: str) -> str:
    path = address[len("unix:"):]
    return path[2:] if path.startswith("//") else path


def check_socket_dir(directory: str) -> None:
    """Raise :class:`KvbmConfigError` unless ``directory`` is ours and private."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        raise KvbmConfigError(f"socket directory {directory} does not exist (is the kvbm node running?)") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise KvbmConfigError(f"socket directory {directory} is not a directory (a symlink?); refusing to use it")
    if st.st_uid != os.geteuid():
        raise KvbmConfigError(f"socket directory {directory} belongs to uid {st.st_uid}, not to us "
                              f"(uid {os.geteuid()}); refusing to use it (remove it, or set DYN_KVBM_SOCKET_DIR)")
    if st.st_mode & 0o077:
        raise KvbmConfigError(f"socket directory {directory} has mode {stat.S_IMODE(st.st_mode):o}; it must be "
                              f"0700 (chmod 700 {directory}); refusing to use it")


def ensure_socket_dir(directory: str) -> None:
    """Create ``directory`` (0700) if missing, then :func:`check_socket_dir` it."""
    try:
        os.makedirs(directory, mode=0o700)
    except FileExistsError:
        pass
    check_socket_dir(directory)


#: Longest unix socket path Linux binds (``sun_path`` is 108 bytes with the terminating NUL).
MAX_UNIX_PATH_BYTES = 107


def prepare_unix_socket(address: str) -> str:
    """Create or check the socket's directory and remove a stale socket file; returns the path.

    Raises:
        KvbmConfigError: the path is longer than a unix socket may be (said before any bind
            fails with a bare "AF_UNIX path too long").
    """
    path = unix_path(address)
    size = len(os.fsencode(path))
    if size > MAX_UNIX_PATH_BYTES:
        raise KvbmConfigError(f"unix socket path {path} is {size} bytes, longer than the {MAX_UNIX_PATH_BYTES} "
                              "a unix socket allows: set DYN_KVBM_SOCKET_DIR to a shorter directory")
    ensure_socket_dir(os.path.dirname(path) or ".")
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
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
