"""Limited subprocesses for untrusted candidate code.

``run_limited(argv, cwd, limits, env)`` starts ``argv`` in its own session with CPU-time, address-space,
file-size and core-dump limits (``resource.setrlimit``), in a fresh network namespace when the OS allows
it (``unshare -n``: no interface but a downed loopback), and kills the whole process group at the wall
clock timeout. It never raises for what the child does; the ``Outcome`` says how it ended. What runs
inside (the audit-hook tripwire that stops file reads outside the repository and connection attempts)
lives in ``flashinfra.agent.guard``; this module is the OS-level boundary around it.

Where bubblewrap (``bwrap``) can make namespaces, the child runs inside it: the whole filesystem
read-only (the repository included) except the candidate's worktree and the evaluation directory, an
empty ``/tmp`` (but for the interpreter, its venv and its ``PYTHONPATH`` entries when they live there,
read-only), its own ``/dev`` and ``/proc``, and no network (``--unshare-net``). Where it cannot
(``filesystem_sandbox()`` says why), the ``unshare -n`` network namespace and the audit hook remain.

``candidate_env`` builds a child environment from scratch (an allowlist, never a copy of ours), so an
API key in the agent's environment cannot reach candidate code.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flashinfra import env as fi_env
from flashinfra.agent.campaign_goals import SandboxLimits

VIOLATION_EXIT = 86  # the guard's exit status after it stopped a forbidden action


@dataclass
class Outcome:
    returncode: int | None
    timed_out: bool
    wall_s: float
    stdout: str
    stderr: str
    violations: list[dict] = field(default_factory=list)
    network_isolation: str = ""
    timeout_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.violations

    def failure(self) -> str:
        """One line saying why the run does not count; empty when it does."""
        if self.violations:
            v = self.violations[0]
            return f"stopped by the sandbox: {v.get('kind')} {v.get('detail')}"
        if self.timed_out:
            return f"killed at the {self.timeout_s:g} s timeout"
        if self.returncode != 0:
            tail = (self.stderr.strip().splitlines() or ["(no output)"])[-1]
            if self.returncode is not None and self.returncode < 0:
                tail = f"signal {signal.Signals(-self.returncode).name}; {tail}"
            return f"exit status {self.returncode}: {tail[:300]}"
        return ""

    def to_dict(self) -> dict:
        return {"returncode": self.returncode, "timed_out": self.timed_out, "wall_s": round(self.wall_s, 3),
                "violations": self.violations, "network_isolation": self.network_isolation,
                "stderr_tail": self.stderr[-2000:]}


@functools.lru_cache(maxsize=1)
def network_isolation() -> tuple[tuple[str, ...], str]:
    """(argv prefix that starts a command in a new network namespace, description). The prefix is empty,
    and the description says why, when no namespace can be made here."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return (), "unavailable: no unshare(1) on this machine"
    for prefix in ((unshare, "-n", "--"), (unshare, "-r", "-n", "--")):
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return (), f"unavailable: {exc}"
        if probe.returncode == 0:
            return prefix, "network namespace (" + " ".join(prefix[1:-1]) + ")"
    reason = probe.stderr.decode(errors="replace").strip().splitlines()
    return (), "unavailable: " + (reason[-1] if reason else "unshare failed")


@functools.lru_cache(maxsize=1)
def filesystem_sandbox() -> tuple[str | None, str]:
    """(path of a working bwrap, description); (None, why not) where none works here."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None, "unavailable: no bwrap on this machine (apt-get install bubblewrap)"
    try:
        probe = subprocess.run([bwrap, *_bwrap_args([]), "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"unavailable: {exc}"
    if probe.returncode != 0:
        reason = probe.stderr.decode(errors="replace").strip().splitlines()
        return None, "unavailable: " + (reason[-1] if reason else f"bwrap exited with {probe.returncode}")
    return bwrap, "bubblewrap (read-only filesystem but the worktree and evaluation dir, network namespace)"


def _bwrap_args(writable: list[Path], readable: list[Path] = ()) -> list[str]:
    """bwrap's options: ``writable`` bound read-write, and what of ``readable`` lies below the empty
    ``/tmp`` bound read-only there (elsewhere it is visible already; ``/tmp`` itself is never shown)."""
    args = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
            "--unshare-net", "--unshare-ipc", "--unshare-uts", "--die-with-parent"]
    hidden = {os.path.realpath(p) for p in readable}
    binds = [(p, "--ro-bind") for p in hidden if p.startswith("/tmp/") and os.path.exists(p)]
    binds += [(os.path.realpath(p), "--bind") for p in writable]
    # parents before children, so a later bind inside an earlier one stays visible
    for path, option in sorted(dict(binds).items(), key=lambda item: len(item[0])):
        args += [option, path, path]
    return args


def _interpreter_paths(argv: list[str], env: dict[str, str]) -> list[Path]:
    """What the child's Python needs to see: its installation and venv (the command's, when it runs an
    interpreter, and ours, which ``sys.executable`` names), and the ``PYTHONPATH`` entries it is given."""
    paths = {Path(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    program = shutil.which(argv[0], path=env.get("PATH")) if argv else None
    if program is not None:
        # a venv's bin/python is a link out of the venv: the venv (pyvenv.cfg) is beside the link's folder,
        # the installation beside the target's
        paths |= {Path(program).absolute().parent.parent, Path(os.path.realpath(program)).parent.parent}
    paths |= {Path(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p}
    return sorted(paths)


def _limit(limits: SandboxLimits):
    cpu = int(limits.cpu_s)
    memory = int(limits.memory_mb) * 2**20

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**30, 2**30))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def candidate_env(pythonpath: list[Path], home: Path, secrets: tuple[str, ...] = ()) -> dict[str, str]:
    """A fresh environment for candidate code: the allowlisted variables, HOME/TMPDIR in the evaluation's
    own directory, and PYTHONPATH. Any value containing one of ``secrets`` is dropped."""
    tmp = home / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    child = dict(fi_env.sandbox_passthrough())
    child.update(HOME=str(home), TMPDIR=str(tmp), PYTHONDONTWRITEBYTECODE="1", PYTHONNOUSERSITE="1",
                 PYTHONPATH=os.pathsep.join(str(p) for p in pythonpath))
    return {k: v for k, v in child.items() if not any(s and s in v for s in secrets)}


def run_limited(argv: list[str], cwd: Path, limits: SandboxLimits, env: dict[str, str],
                violations_file: Path | None = None, timeout_s: float | None = None,
                writable: list[Path] | None = None) -> Outcome:
    """Run ``argv`` under the limits; see the module docstring. ``writable``: what the child may write
    (default: ``cwd``); the violations file's directory and the env's HOME/TMPDIR are added."""
    bwrap, fs_isolation = filesystem_sandbox()
    if bwrap is not None:
        paths = [Path(cwd), *(writable or [])]
        paths += [violations_file.parent] if violations_file is not None else []
        paths += [Path(env[k]) for k in ("HOME", "TMPDIR") if env.get(k)]
        for path in paths:
            path.mkdir(parents=True, exist_ok=True)
        prefix, isolation = (bwrap, *_bwrap_args(paths, _interpreter_paths(argv, env))), fs_isolation
    else:
        prefix, isolation = network_isolation()
    timeout = limits.timeout_s if timeout_s is None else timeout_s
    start = time.monotonic()
    proc = subprocess.Popen([*prefix, *argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=_limit(limits))
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        stdout, stderr = proc.communicate()
    finally:
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
    # Whatever the child left running in its session goes too (a fork that outlived it).
    _kill_group(proc)
    returncode = proc.returncode
    if bwrap is not None and returncode is not None and 128 < returncode < 128 + 65:
        returncode = 128 - returncode  # bwrap reports a child killed by signal N as 128 + N, like a shell
    outcome = Outcome(returncode, timed_out, time.monotonic() - start,
                      stdout.decode(errors="replace"), stderr.decode(errors="replace"),
                      network_isolation=isolation, timeout_s=timeout)
    if violations_file is not None and violations_file.exists():
        for line in violations_file.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                outcome.violations.append(json.loads(line))
            except json.JSONDecodeError:
                outcome.violations.append({"kind": "unreadable", "detail": line[:200]})
    if proc.returncode == VIOLATION_EXIT and not outcome.violations:
        outcome.violations.append({"kind": "unknown", "detail": "the guard stopped the run without a record"})
    return outcome


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
