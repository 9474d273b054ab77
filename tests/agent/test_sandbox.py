"""The sandbox around candidate code: limits, timeouts, network namespace, environment, and the guard."""

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flashinfra.agent.campaign_goals import SandboxLimits
from flashinfra.agent.guard import VIOLATION_EXIT
from flashinfra.agent.sandbox import candidate_env, network_isolation, run_limited

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, code, limits=SandboxLimits(timeout_s=20, cpu_s=20, memory_mb=2048), secrets=()):
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    env = candidate_env([ROOT], work, secrets)
    return run_limited([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, limits=limits, env=env,
                       violations_file=work / "violations.jsonl")


def test_timeout_kills_the_whole_group(tmp_path):
    out = _run(tmp_path, """
        import subprocess, time
        child = subprocess.Popen(["sleep", "60"])
        print(child.pid, flush=True)
        time.sleep(60)
        """, SandboxLimits(timeout_s=4, cpu_s=20, memory_mb=2048))
    assert out.timed_out and not out.ok and "timeout" in out.failure()
    grandchild = int(out.stdout.split()[0])
    status = Path(f"/proc/{grandchild}/status")
    deadline = time.monotonic() + 10  # SIGKILL is delivered at once, but the process dies when scheduled
    while status.exists() and "State:\tZ" not in status.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not status.exists() or "State:\tZ" in status.read_text()


def test_cpu_and_memory_limits(tmp_path):
    out = _run(tmp_path, "while True: pass", SandboxLimits(timeout_s=30, cpu_s=1, memory_mb=2048))
    assert not out.timed_out and out.returncode is not None and out.returncode < 0
    assert "SIGXCPU" in out.failure() or "SIGKILL" in out.failure()
    out = _run(tmp_path, "x = bytearray(3 * 2**30)", SandboxLimits(timeout_s=30, cpu_s=20, memory_mb=512))
    assert out.returncode == 1 and "MemoryError" in out.stderr


def test_network_namespace(tmp_path, listener):
    port, accepted = listener
    prefix, description = network_isolation()
    if not prefix:
        assert description.startswith("unavailable")
        pytest.skip(f"network namespaces {description}")
    out = _run(tmp_path, f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=2)
            print("connected")
        except OSError as exc:
            print("refused", exc.errno)
        """)
    assert out.returncode == 0 and out.stdout.startswith("refused"), out.stdout + out.stderr
    assert accepted == [] and ("network namespace" in out.network_isolation)


def test_environment_is_an_allowlist(tmp_path, monkeypatch):
    key = "sk-sandbox-secret-value-1234"
    monkeypatch.setenv("FLASHINFRA_AGENT_API_KEY", key)
    monkeypatch.setenv("OPENAI_API_KEY", key)
    monkeypatch.setenv("PATH", os.environ["PATH"])
    out = _run(tmp_path, "import os, json; print(json.dumps(dict(os.environ)))", secrets=(key,))
    assert out.ok and key not in out.stdout
    assert '"HOME": "' + str(tmp_path / "work") in out.stdout and '"PATH"' in out.stdout


GUARDED = """
    import sys
    from flashinfra.agent import guard
    guard.arm([{repo!r}, *guard.python_roots()], [{work!r}], {report!r}, guard.import_entries())
    open({inside!r}).read()
    open({work!r} + "/out.txt", "w").write("ok")
    {action}
    print("not stopped")
    """


@pytest.mark.parametrize("action, kind, detail", [
    ("open({outside!r}).read()", "file", "read {outside}"),
    ("open({repo!r} + '/new.txt', 'w')", "file", "write {repo}/new.txt"),
    ("import os; os.listdir('/etc')", "file", "list /etc"),
    ("import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)", "network", "socket.connect"),
    ("import subprocess; subprocess.run(['cat', {outside!r}])", "process", "subprocess.Popen"),
])
def test_guard_stops_and_records(tmp_path, action, kind, detail):
    repo, work = tmp_path / "repo", tmp_path / "work"
    repo.mkdir()
    work.mkdir()
    (repo / "a.py").write_text("x = 1\n")
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    names = dict(repo=str(repo), work=str(work), outside=str(outside), inside=str(repo / "a.py"),
                 report=str(work / "violations.jsonl"))
    code = GUARDED.format(action=action.format(**names), **names)
    out = _run(tmp_path, code)
    assert out.returncode == VIOLATION_EXIT and "not stopped" not in out.stdout
    assert [v["kind"] for v in out.violations] == [kind]
    assert detail.format(**names) in out.violations[0]["detail"]
    assert any("<string>" in frame for frame in out.violations[0]["stack"])
    assert out.failure().startswith(f"stopped by the sandbox: {kind}")
    assert (work / "out.txt").read_text() == "ok"


def test_guard_lets_the_runtime_work(tmp_path):
    """Imports, installed-distribution metadata, temporary files in the workdir: all allowed."""
    repo, work = tmp_path / "repo", tmp_path / "work"
    repo.mkdir()
    work.mkdir()
    (repo / "a.py").write_text("x = 1\n")
    names = dict(repo=str(repo), work=str(work), inside=str(repo / "a.py"), report=str(work / "violations.jsonl"))
    action = ("import importlib.metadata, json, tempfile, email.parser; importlib.metadata.entry_points(); "
              "tempfile.TemporaryFile().write(b'x')")
    out = _run(tmp_path, GUARDED.format(action=action, **names))
    assert out.ok and out.stdout.strip() == "not stopped", out.stderr + str(out.violations)


def test_guard_can_allow_child_processes(tmp_path):
    repo, work = tmp_path / "repo", tmp_path / "work"
    repo.mkdir()
    work.mkdir()
    (repo / "a.py").write_text("x = 1\n")
    code = f"""
        from flashinfra.agent import guard
        guard.arm([{str(repo)!r}, *guard.python_roots()], [{str(work)!r}], {str(work / "violations.jsonl")!r},
                  guard.import_entries(), allow_subprocess=True)
        import subprocess
        print(subprocess.run(["echo", "child ran"], capture_output=True, text=True).stdout.strip(), flush=True)
        open("/etc/hostname").read()
        """
    out = _run(tmp_path, code)
    assert out.stdout.strip() == "child ran", out.violations
    assert out.returncode == VIOLATION_EXIT and out.violations[0]["detail"] == "read /etc/hostname"


def _needs_bwrap():
    from flashinfra.agent.sandbox import filesystem_sandbox

    bwrap, description = filesystem_sandbox()
    if bwrap is None:
        pytest.skip(f"bubblewrap {description}")


def test_bwrap_repository_is_read_only_and_tmp_is_private(tmp_path):
    _needs_bwrap()
    secret = Path("/tmp") / f"flashinfra-host-secret-{os.getpid()}"
    secret.write_text("s3cret")
    try:
        out = _run(tmp_path, f"""
            import os
            results = []
            try:
                open({str(ROOT / "README.md")!r}, "a").write("x")
                results.append("wrote-repo")
            except OSError as exc:
                results.append(f"repo-ro:{{exc.errno}}")
            results.append("secret-visible" if os.path.exists({str(secret)!r}) else "secret-hidden")
            open("own.txt", "w").write("ok")  # the run's own directory stays writable
            results.append("own-ok")
            print(" ".join(results))
            """)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["repo-ro:30", "secret-hidden", "own-ok"], out.stdout
        assert (tmp_path / "own.txt").read_text() == "ok"
        assert out.network_isolation.startswith("bubblewrap")
    finally:
        secret.unlink()


def test_bwrap_escape_through_a_c_level_write_is_stopped(tmp_path):
    """What the audit hook cannot see (ctypes calling libc directly) the filesystem namespace still stops."""
    _needs_bwrap()
    target = ROOT / f".bwrap-escape-{os.getpid()}"
    out = _run(tmp_path, f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.open({str(target).encode()!r}, os.O_WRONLY | os.O_CREAT, 0o644)
        print(fd, ctypes.get_errno())
        """)
    assert out.returncode == 0, out.stderr
    fd, errno = map(int, out.stdout.split())
    assert fd == -1 and errno == 30 and not target.exists()


def test_bwrap_interpreter_in_a_venv_under_tmp(tmp_path, tmp_path_factory):
    """A venv outside the run's own directory but under /tmp (hidden by bubblewrap's empty /tmp) still
    runs the child, and the guard inside it still stops a read outside its roots."""
    import subprocess

    _needs_bwrap()
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)
    repo, work = tmp_path / "repo", tmp_path / "work"
    repo.mkdir()
    work.mkdir()
    (repo / "a.py").write_text("x = 1\n")
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    names = dict(repo=str(repo), work=str(work), outside=str(outside), inside=str(repo / "a.py"),
                 report=str(work / "violations.jsonl"))
    code = GUARDED.format(action="print(sys.prefix, flush=True); open({outside!r}).read()".format(**names), **names)
    out = run_limited([str(venv / "bin" / "python"), "-c", textwrap.dedent(code)], cwd=tmp_path,
                      limits=SandboxLimits(timeout_s=20, cpu_s=20, memory_mb=2048),
                      env=candidate_env([ROOT], work), violations_file=work / "violations.jsonl")
    assert out.stdout.strip() == str(venv), (out.stderr, out.returncode, out.violations)
    assert out.returncode == VIOLATION_EXIT and out.violations[0]["detail"] == f"read {outside}", out.violations


def test_bwrap_never_shows_the_hosts_tmp(tmp_path):
    from flashinfra.agent.sandbox import _bwrap_args

    args = _bwrap_args([], [Path("/tmp"), tmp_path, Path("/usr")])
    binds = [args[i + 1] for i, a in enumerate(args) if a == "--ro-bind"]
    assert binds == ["/", os.path.realpath(tmp_path)]
