"""Repository confinement and guardrails for every path the agent names.

``confine(root, path)`` turns a path the model gave into a real path inside ``root`` or raises
``PathError``: absolute paths, ``..`` escapes and symlinks that lead (at any component) outside the root
are refused, and so is anything under ``.git``. ``Guardrails`` decides whether a repository-relative path
may be edited: it must match an editable glob and no read-only glob. Globs use ``*`` (within one path
component), ``?`` and ``**`` (any number of components).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


class PathError(PermissionError):
    """A path outside the repository, through a symlink that leaves it, or into ``.git``."""


def confine(root: Path, path: str | os.PathLike, *, must_exist: bool = False) -> Path:
    """The resolved path of ``path`` (relative to ``root``) if it stays inside ``root``."""
    root = Path(root).resolve()
    text = os.fspath(path)
    if not text or "\x00" in text:
        raise PathError(f"invalid path {text!r}")
    rel = PurePosixPath(text)
    if rel.is_absolute():
        raise PathError(f"{text}: absolute paths are not allowed; give a path relative to the repository")
    if ".." in rel.parts:
        raise PathError(f"{text}: '..' is not allowed")
    if rel.parts and rel.parts[0] == ".git":
        raise PathError(f"{text}: the .git directory is off limits")
    # Walk component by component so that a symlink anywhere on the way is judged by where it leads.
    current = root
    for part in rel.parts:
        current = current / part
        if current.is_symlink():
            target = current.resolve()
            if target != root and root not in target.parents:
                raise PathError(f"{text}: {current.relative_to(root)} is a symlink leading outside the repository")
    resolved = (root / rel).resolve()
    if resolved != root and root not in resolved.parents:
        raise PathError(f"{text}: resolves outside the repository")
    if must_exist and not resolved.exists():
        raise FileNotFoundError(f"{text}: no such file in the repository")
    return resolved


def relative(root: Path, path: str | os.PathLike) -> str:
    """Repository-relative POSIX path of a confined path."""
    return confine(root, path).relative_to(Path(root).resolve()).as_posix()


@functools.lru_cache(maxsize=512)
def _glob_regex(pattern: str) -> re.Pattern:
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def glob_match(pattern: str, path: str) -> bool:
    """``path`` (repository-relative, POSIX) matches ``pattern``; a pattern naming a directory matches
    everything below it."""
    pattern = pattern.strip("/")
    return bool(_glob_regex(pattern).match(path) or _glob_regex(pattern + "/**").match(path))


@dataclass(frozen=True)
class Guardrails:
    editable: tuple[str, ...]
    read_only: tuple[str, ...]

    def why_not_editable(self, path: str) -> str | None:
        """None when ``path`` may be edited, else the reason."""
        for pattern in self.read_only:
            if glob_match(pattern, path):
                return f"{path} is read-only (matches {pattern!r})"
        if not any(glob_match(p, path) for p in self.editable):
            return f"{path} is outside the editable paths ({', '.join(self.editable)})"
        return None

    def violations(self, paths: list[str]) -> list[str]:
        return [why for why in map(self.why_not_editable, paths) if why]
