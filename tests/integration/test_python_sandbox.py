"""The `python` tool, run for real: each escape attempt or runaway comes back to the model as
a tool error naming the cause, and the next call still works; output, scratch, concurrency
and YAML configuration behave as documented.

The tool is built from a tools YAML (short limits), with a "run directory" holding a
secret as protected dir. The main tests run under `isolation: auto` (bubblewrap where
installed, else namespaces via `unshare` where allowed; skipped where neither works, since
auto then refuses the tool) and again under `unshare` where auto chose bubblewrap; a second
tool names `isolation: audit` (no isolation, an audit hook only) so that mode is exercised
too. Without bwrap and unshare, auto refuses the tool in one line, and only `audit` by name runs.
"""

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from async_rl.agent.tools import load_tools
from async_rl.agent.tools.isolation import detect_isolation
from async_rl.agent.tools.python_sandbox import PythonTool

SECRET = "s3cret-token-7f1c"
TOOLS_YAML = """\
tools:
  - name: python
    config:
      timeout_s: 3
      cpu_s: 2
      memory_mb: 512
      max_processes: 16
      max_output_chars: 600
      scratch_root: {scratch}
      protected_dirs: [{run}]
      isolation: {isolation}
  - name: calculator
"""


class TcpServer:
    """A localhost listener that counts the connections it accepts."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port, self.accepted, self.stop = self.sock.getsockname()[1], 0, False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self):
        self.stop = True
        self.thread.join()
        self.sock.close()


def _build(tmp, isolation):
    run_dir, scratch = tmp / "run", tmp / f"scratch_{isolation}"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "secret.txt").write_text(SECRET)
    path = tmp / f"tools_{isolation}.yaml"
    path.write_text(TOOLS_YAML.format(scratch=scratch, run=run_dir, isolation=isolation))
    tools = load_tools(path)
    asyncio.run(tools["python"].create("ep"))
    return tools["python"]


@pytest.fixture(scope="module", params=["auto", "unshare"])
def env(request, tmp_path_factory):
    try:
        auto = detect_isolation("auto", sys.executable).name
    except ValueError:
        pytest.skip("neither bubblewrap nor user namespaces work here: isolation: auto refuses the tool")
    if request.param != "auto" and auto == request.param:
        pytest.skip(f"isolation: auto is {request.param} here")
    tmp = tmp_path_factory.mktemp("sandbox")
    os.chmod(tmp, 0o755)
    tool = _build(tmp, request.param)
    server = TcpServer()
    yield tool, tmp, server
    server.close()
    asyncio.run(tool.release("ep"))


@pytest.fixture(scope="module")
def fallback(env):
    tool = _build(env[1], "audit")
    yield tool
    asyncio.run(tool.release("ep"))


def run(tool, code, instance="ep"):
    return asyncio.run(tool.execute(instance, {"code": code}))


def assert_refused(tool, code, *causes):
    """The call is a tool error naming one of `causes`, and the tool still works afterwards."""
    result = run(tool, code)
    assert result.error, result.text
    assert any(c in result.text for c in causes), result.text
    assert SECRET not in result.text
    after = run(tool, "print('still works', 6 * 7)")
    assert not after.error and after.text == "still works 42", after.text
    return result


def test_runs_code_and_prints_its_output(env):
    tool = env[0]
    result = run(tool, "import math\nfor i in range(3):\n    print(i, math.factorial(i + 3))")
    assert not result.error and result.text == "0 6\n1 24\n2 120"
    assert result.metrics["tool/python_wall_s"] > 0 and result.metrics["tool/python_error"] == 0.0
    failed = assert_refused(tool, "def f(:\n  pass", "syntax error")
    assert "SyntaxError" in failed.text
    raised = assert_refused(tool, "x = 1\nraise ValueError('bad value')", "exception: ValueError: bad value")
    assert 'line 2' in raised.text and "sandbox_runner" not in raised.text


def test_network_is_refused(env):
    tool, _, server = env
    connect = f"import socket\nsocket.create_connection(('127.0.0.1', {server.port}), timeout=2)\nprint('connected')"
    assert_refused(tool, connect, "network access is disabled", "Network is unreachable")
    assert_refused(tool, "import socket\nprint(socket.getaddrinfo('example.com', 443))",
                   "network access is disabled", "Temporary failure", "Name or service not known")
    if tool.isolation.namespaces:  # a child process has no audit hook: the net namespace's own loopback stops it
        child = ("import subprocess, sys\nr = subprocess.run([sys.executable, '-c', " + repr(connect) + "], "
                 "capture_output=True, text=True)\nprint(r.returncode, r.stderr.strip().splitlines()[-1])")
        result = run(tool, child)
        assert "connected" not in result.text, result.text
        assert ("Network is unreachable" if tool.isolation.name == "unshare" else "Connection refused") \
            in result.text, result.text
    assert server.accepted == 0


def test_writes_outside_scratch_are_refused(env):
    tool, tmp, _ = env
    target = tmp / "outside.txt"
    assert_refused(tool, f"open({str(target)!r}, 'w').write('x')", "only the scratch directory is writable")
    assert_refused(tool, f"import os\nos.mkdir({str(tmp / 'newdir')!r})", "only the scratch directory is writable")
    if tool.isolation.namespaces:  # past the hook: the mount is read-only
        result = run(tool, f"import subprocess\nprint(subprocess.run(['sh', '-c', 'echo x > {target}'], "
                           "capture_output=True, text=True).stderr)")
        assert "Read-only file system" in result.text, result.text
    assert not target.exists() and not (tmp / "newdir").exists()


def test_protected_run_directory_is_unreadable(env):
    tool, tmp, _ = env
    secret = tmp / "run" / "secret.txt"
    assert_refused(tool, f"print(open({str(secret)!r}).read())", "protected directory")
    assert_refused(tool, f"import os\nprint(os.listdir({str(tmp / 'run')!r}))", "protected directory",
                   "Permission denied")
    if tool.isolation.namespaces:  # past the hook: an empty tmpfs covers the directory
        result = run(tool, f"import subprocess\nprint(subprocess.run(['cat', '{secret}'], "
                           "capture_output=True, text=True))")
        assert SECRET not in result.text and ("Permission denied" in result.text or "No such file" in result.text)


def test_fork_bomb_is_stopped(env):
    assert_refused(env[0], "import os\nwhile True:\n    os.fork()", "process limit", "fork is disabled")


def test_infinite_loop_is_stopped(env):
    result = assert_refused(env[0], "while True:\n    pass", "CPU time limit", "timeout")  # a limit ended it
    assert result.metrics["tool/python_wall_s"] > 0  # no clock bound: a loaded machine stretches a CPU limit's wall


def test_huge_allocation_is_stopped(env):
    assert_refused(env[0], "x = bytearray(10 * 1024**3)\nprint(len(x))", "memory limit")


def test_long_output_is_truncated(env):
    result = run(env[0], "print('a' * 20000)\nprint('the end')")
    assert not result.error and "output truncated" in result.text
    assert len(result.text) < 600 + 100 and result.text.endswith("the end")
    assert result.metrics["tool/python_output_chars"] > 20000


def test_scratch_dir_is_writable_and_removed_on_release(env):
    tool = env[0]
    asyncio.run(tool.create("ep2"))
    scratch = tool.scratch_dir("ep2")
    assert run(tool, "open('notes.txt', 'w').write('kept')", "ep2").text == "(no output)"
    result = run(tool, "import os\nprint(os.getcwd(), open('notes.txt').read())", "ep2")
    assert result.text == f"{scratch} kept"
    assert (scratch / "notes.txt").read_text() == "kept"
    asyncio.run(tool.release("ep2"))
    assert not scratch.exists()
    assert "unknown instance" in run(tool, "print(1)", "ep2").text


def test_calls_run_concurrently(env):
    tool = env[0]

    code = "import time\nt0 = time.time()\ntime.sleep(1)\nprint(t0, time.time())"

    async def two():
        return await asyncio.gather(*(tool.execute("ep", {"code": code}) for _ in range(2)))

    (s1, e1), (s2, e2) = ([float(x) for x in r.text.split()] for r in asyncio.run(two()))
    # each call's own span, as it saw it: the two overlap (a bound on order, not on the clock: load-proof)
    assert s1 < e2 and s2 < e1, f"one call ran after the other: [{s1:.2f}, {e1:.2f}] and [{s2:.2f}, {e2:.2f}]"


def test_yaml_configures_the_limits(env):
    tool, tmp, _ = env
    assert isinstance(tool, PythonTool)
    c = tool.cfg
    assert (c.timeout_s, c.cpu_s, c.memory_mb, c.max_processes, c.max_output_chars) == (3, 2, 512, 16, 600)
    assert c.scratch_root == str(tmp / f"scratch_{c.isolation}") and c.protected_dirs == [str(tmp / "run")]
    # 512 MB of address space: 300 MB fits, 700 MB does not
    assert not run(tool, "x = bytearray(300 * 2**20)\nprint('ok')").error
    assert "memory_mb=512" in run(tool, "x = bytearray(700 * 2**20)").text
    bad = tmp / "bad.yaml"
    bad.write_text("tools:\n  - name: python\n    config: {timeout_s: 3, wall_s: 1}\n")
    with pytest.raises(ValueError, match="wall_s"):
        load_tools(bad)
    bad.write_text("tools:\n  - name: python\n    config: {isolation: chroot}\n")
    with pytest.raises(ValueError, match="isolation"):
        load_tools(bad)


def test_bad_arguments_are_tool_errors(env):
    tool = env[0]
    for arguments in ({}, {"code": ""}, {"code": 5}, {"source": "print(1)"}):
        result = asyncio.run(tool.execute("ep", arguments))
        assert result.error and "`code`" in result.text


@pytest.mark.parametrize("code, causes", [
    ("import socket\nsocket.create_connection(('127.0.0.1', 1), timeout=1)", ["network access is disabled"]),
    ("open('/tmp/async_rl_sandbox_escape', 'w')", ["only the scratch directory is writable"]),
    ("import subprocess\nsubprocess.run(['true'])", ["disabled in this sandbox (audit mode)"]),
    ("import os\nwhile True:\n    os.fork()", ["process limit", "fork is disabled"]),
    ("x = bytearray(10 * 1024**3)", ["memory limit"]),
])
def test_fallback_mode_refuses_too(fallback, code, causes):
    assert fallback.isolation.name == "audit" and not fallback.isolation.namespaces
    assert_refused(fallback, code, *causes)
    secret = os.path.join(fallback.cfg.protected_dirs[0], "secret.txt")
    assert_refused(fallback, f"print(open({secret!r}).read())", "protected directory")
    assert not os.path.exists("/tmp/async_rl_sandbox_escape")


def test_the_code_runs_as_a_throw_away_uid_without_capabilities(env):
    tool = env[0]
    if not tool.drops_uid:
        pytest.skip("not root: the code runs in a nested user namespace instead")
    result = run(tool, "import os\nstatus = open('/proc/self/status').read()\n"
                       "print(os.getuid(), status.split('CapEff:')[1].split()[0])")
    uid, cap_eff = result.text.split()
    assert int(uid) >= 10**9 and int(cap_eff, 16) == 0, result.text


def test_without_bwrap_and_unshare_auto_refuses_the_tool_and_only_audit_by_name_runs(tmp_path, monkeypatch, caplog):
    """The machine of a container without bubblewrap or user namespaces, as far as the probes can
    tell: neither program is on PATH."""
    monkeypatch.setenv("PATH", str(tmp_path))
    detect_isolation.cache_clear()
    try:
        with pytest.raises(ValueError) as refused:
            PythonTool(isolation="auto").prepare()
        assert str(refused.value) == (
            "python tool refused: no isolation works on this machine (bwrap: `bwrap` is not installed; unshare: "
            "`unshare` is not installed); install bubblewrap or allow unprivileged user namespaces, or set "
            "`isolation: audit` in its config to run model code with NO isolation (an audit hook and rlimits only)")
        with caplog.at_level("WARNING", logger="async_rl.agent.tools.isolation"):
            tool = PythonTool(isolation="audit", scratch_root=str(tmp_path / "scratch"))
            tool.prepare()
        assert tool.isolation.name == "audit" and "NO isolation" in caplog.text
        asyncio.run(tool.create("ep"))
        assert run(tool, "print(6 * 7)").text == "42"
        asyncio.run(tool.release("ep"))
    finally:
        detect_isolation.cache_clear()  # the other tests probe the real machine again


def test_auto_prefers_bubblewrap_where_it_works():
    from async_rl.agent.tools.isolation import ISOLATIONS, _probe

    if _probe(ISOLATIONS["bwrap"], sys.executable) is not None:
        pytest.skip("bubblewrap is not installed or cannot run here")
    assert list(ISOLATIONS)[0] == "bwrap" and detect_isolation("auto", sys.executable).name == "bwrap"


def test_bwrap_hides_a_protected_dir_inside_a_re_exposed_one(tmp_path):
    """As root, a directory the code's uid could not enter is re-exposed from the host; a protected
    directory inside it must stay hidden (bwrap binds from the host tree, so order matters)."""
    from async_rl.agent.tools.isolation import ISOLATIONS, _probe, new_uid

    iso = ISOLATIONS["bwrap"]
    if os.geteuid() != 0 or _probe(iso, sys.executable) is not None:
        pytest.skip("needs root and a working bubblewrap")
    closed = tmp_path / "closed"
    (closed / "exposed" / "protected").mkdir(parents=True)
    closed.chmod(0o700)
    (closed / "exposed" / "protected" / "secret.txt").write_text(SECRET)
    (closed / "exposed" / "visible.txt").write_text("visible")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    uid = new_uid()
    os.chown(scratch, uid, uid)
    settings = {"scratch": str(scratch), "protected": [str(closed / "exposed" / "protected")],
                "expose": [str(closed / "exposed")], "uid": uid}
    shell = (f"cat {closed}/exposed/visible.txt; ls -A {closed}/exposed/protected; "
             f"cat {closed}/exposed/protected/secret.txt")
    done = subprocess.run([*iso.prefix(settings), "/bin/sh", "-c", shell], capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("visible") and SECRET not in done.stdout + done.stderr, (done.stdout, done.stderr)
    assert "Permission denied" in done.stderr
