"""Git plumbing for campaigns: one worktree per candidate, its diff, its commit, and the merge a person
approves.

Every git call goes through ``git()``, which raises ``GitError`` carrying git's own message. Commits the
Infra Agent makes carry the author ``flashinfra Infra Agent``; merges made on approval are the person's,
with their configured identity when there is one.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

AGENT_IDENTITY = ("-c", "user.name=flashinfra Infra Agent", "-c", "user.email=infra-agent@flashinfra.invalid")


class GitError(RuntimeError):
    pass


def git(cwd: Path, *args: str, check: bool = True, identity: bool = False) -> str:
    argv = ["git", *(AGENT_IDENTITY if identity else ()), *args]
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise GitError(f"git {' '.join(args)} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def toplevel(path: Path) -> Path:
    try:
        return Path(git(path, "rev-parse", "--show-toplevel").strip()).resolve()
    except (GitError, FileNotFoundError):
        raise GitError(f"{path} is not inside a git repository") from None


def rev_parse(repo: Path, rev: str) -> str:
    return git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}").strip()


def add_worktree(repo: Path, path: Path, base: str, branch: str | None = None) -> Path:
    """A new worktree at ``path`` checked out at ``base`` (on a new ``branch``, or detached)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if branch:
        git(repo, "worktree", "add", "-q", "-b", branch, str(path), base)
    else:
        git(repo, "worktree", "add", "-q", "--detach", str(path), base)
    return path.resolve()


def ensure_worktree(repo: Path, path: Path, base: str, branch: str | None = None) -> Path:
    """``add_worktree`` unless it already exists (a resumed campaign)."""
    if (path / ".git").exists():
        return path.resolve()
    if branch and git(repo, "branch", "--list", branch).strip():
        git(repo, "worktree", "add", "-q", str(path), branch)
        return path.resolve()
    return add_worktree(repo, path, base, branch)


def changed_files(worktree: Path, base: str) -> list[str]:
    """Every path that differs from ``base``: committed, staged, unstaged and untracked."""
    names = set(git(worktree, "diff", "--name-only", "--no-renames", base).split("\n"))
    names |= set(git(worktree, "ls-files", "--others", "--exclude-standard").split("\n"))
    return sorted(n for n in names if n)


def symlinks_changed(worktree: Path, base: str) -> list[str]:
    """Changed paths that are symlinks now (the file tools never create one; a patch could)."""
    return [p for p in changed_files(worktree, base) if (worktree / p).is_symlink()]


def diff(worktree: Path, base: str) -> str:
    """The candidate's full diff against ``base``, untracked files included."""
    git(worktree, "add", "-A", "--intent-to-add")
    return git(worktree, "diff", "--no-color", base)


def commit_all(worktree: Path, message: str) -> str:
    """Commit everything in the worktree (nothing to commit is fine); returns HEAD."""
    git(worktree, "add", "-A")
    if git(worktree, "status", "--porcelain").strip():
        git(worktree, "commit", "-q", "--no-verify", "-m", message, identity=True)
    return rev_parse(worktree, "HEAD")


def dirty(worktree: Path) -> list[str]:
    return [line[3:] for line in git(worktree, "status", "--porcelain").splitlines() if line.strip()]


def merge(repo: Path, commit: str, message: str) -> str:
    """Merge ``commit`` into the branch checked out in ``repo`` (never fast-forward, so the approval is
    one visible merge commit). Returns the new HEAD."""
    has_identity = bool(git(repo, "config", "user.email", check=False).strip())
    try:
        git(repo, "merge", "--no-ff", "--no-edit", "-m", message, commit, identity=not has_identity)
    except GitError:
        # A conflict must not leave the person's checkout half-merged.
        git(repo, "merge", "--abort", check=False)
        raise
    return rev_parse(repo, "HEAD")


def remove_worktree(repo: Path, path: Path) -> None:
    git(repo, "worktree", "remove", "--force", str(path), check=False)
