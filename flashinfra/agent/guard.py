"""The tripwire inside an evaluation subprocess: an audit hook (PEP 578) armed before candidate code is
imported.

Once armed, the process is stopped (exit status ``sandbox.VIOLATION_EXIT``) the moment it tries to

- open or list a file outside the allowed read roots (the candidate worktree, the evaluation directory,
  the Python installation and the trusted ``flashinfra`` package), or write outside the evaluation
  directory;
- connect or send on a socket (any family);
- start a process (``subprocess``, ``os.system``, ``exec``, ``posix_spawn``, ``fork``), which would
  escape the hook, unless the goals allow it (``[sandbox] allow_subprocess``).

Each stop is written first, as one JSON line, to a file descriptor opened before arming, so the parent
records what was attempted and from where. Audit hooks cannot be removed, and the stop is ``os._exit``,
which candidate code cannot catch. Code in C extensions can act without raising audit events: the OS
boundary (network namespace, resource limits) in ``flashinfra.agent.sandbox`` covers what this misses.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import threading

VIOLATION_EXIT = 86

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PROCESS_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                   "os.forkpty", "pty.spawn")
_NETWORK_EVENTS = ("socket.connect", "socket.sendto", "socket.sendmsg")
_WRITE_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.truncate",
                 "os.chmod", "os.chown", "shutil.rmtree", "shutil.copyfile", "shutil.move")
# Files the runtime itself reads lazily (CPU topology, time zone, entropy) that reveal nothing of the host.
_SYSTEM_READ = ("/dev/null", "/dev/urandom", "/dev/random", "/dev/shm", "/proc/self", "/proc/thread-self",
                f"/proc/{os.getpid()}", "/proc/cpuinfo", "/proc/meminfo", "/proc/stat",
                "/sys/devices/system/cpu", "/sys/fs/cgroup", "/etc/localtime", "/usr/share/zoneinfo")


def python_roots() -> list[str]:
    """Where the interpreter's own code lives: stdlib, site-packages, the trusted flashinfra package, and
    the installed-distribution metadata beside any import path (``importlib.metadata`` reads it)."""
    import flashinfra
    import site

    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(site.getsitepackages())
    roots.add(os.path.dirname(os.path.abspath(flashinfra.__file__)))
    for entry in (e or os.getcwd() for e in sys.path):
        if os.path.isdir(entry):
            roots.update(os.path.join(entry, name) for name in os.listdir(entry)
                         if name.endswith((".dist-info", ".egg-info")))
    return sorted(os.path.realpath(r) for r in roots)


def import_entries() -> list[str]:
    """The import path's entries themselves: listing a directory entry or opening a zip entry (not reading
    below them) is how imports and ``importlib.metadata`` find things."""
    return sorted({os.path.realpath(e or os.getcwd()) for e in sys.path})


class Guard:
    def __init__(self, read_roots: list[str], write_roots: list[str], report_fd: int,
                 path_entries: list[str] = (), allow_subprocess: bool = False):
        self.write_roots = tuple(os.path.realpath(r) for r in write_roots)
        self.read_roots = tuple(os.path.realpath(r) for r in read_roots) + self.write_roots + _SYSTEM_READ
        self.path_entries = frozenset(os.path.realpath(r) for r in path_entries)
        self.report_fd = report_fd
        self.allow_subprocess = allow_subprocess
        self._busy = threading.local()

    @staticmethod
    def _under(path: str, roots: tuple[str, ...]) -> bool:
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

    def _path(self, raw) -> str | None:
        if raw is None or isinstance(raw, int):
            return None
        return os.path.realpath(os.fsdecode(raw))

    def stop(self, kind: str, detail: str) -> None:
        frames, frame = [], sys._getframe(2)
        # File names and line numbers only: reading source lines would open files inside the hook.
        while frame is not None and len(frames) < 12:
            frames.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
            frame = frame.f_back
        record = {"kind": kind, "detail": detail, "thread": threading.current_thread().name, "stack": frames}
        try:
            os.write(self.report_fd, (json.dumps(record) + "\n").encode())
        finally:
            os._exit(VIOLATION_EXIT)

    def __call__(self, event: str, args: tuple) -> None:
        if getattr(self._busy, "on", False):
            return
        self._busy.on = True
        try:
            self._check(event, args)
        finally:
            self._busy.on = False

    def _check(self, event: str, args: tuple) -> None:
        if event == "open":
            path = self._path(args[0])
            if path is None:
                return
            mode, flags = args[1], args[2] or 0
            writing = bool(mode and any(c in mode for c in "wax+")) or bool(flags & _WRITE_FLAGS)
            if writing and not self._under(path, self.write_roots):
                self.stop("file", f"write {path}")
            if not writing and path not in self.path_entries and not self._under(path, self.read_roots):
                self.stop("file", f"read {path}")
        elif event in ("os.listdir", "os.scandir"):
            path = self._path(args[0] if args else ".")
            if path is not None and path not in self.path_entries and not self._under(path, self.read_roots):
                self.stop("file", f"list {path}")
        elif event in _WRITE_EVENTS:
            for raw in args[:2]:
                path = self._path(raw) if isinstance(raw, (str, bytes, os.PathLike)) else None
                if path is not None and not self._under(path, self.write_roots):
                    self.stop("file", f"{event} {path}")
        elif event in _NETWORK_EVENTS:
            self.stop("network", f"{event} to {args[1]!r}")
        elif event in _PROCESS_EVENTS and not self.allow_subprocess:
            self.stop("process", f"{event} {str(args[:2])[:200]}")


def arm(read_roots: list[str], write_roots: list[str], report_path: str, path_entries: list[str] = (),
        allow_subprocess: bool = False) -> None:
    """Install the hook for the rest of this process's life."""
    fd = os.open(report_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.addaudithook(Guard(read_roots, write_roots, fd, path_entries, allow_subprocess))
