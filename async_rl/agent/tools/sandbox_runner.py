"""The child side of the `python` tool: confine a process, then run the model's code in it.

Started by `python_sandbox.PythonTool` as `python -I -B sandbox_runner.py '<json settings>'`
(under `bwrap`, or inside `unshare` namespaces, when the machine allows) with the code on
stdin. Standard library only: it runs apart from the rest of the package.

This process is the supervisor: the pid namespace (unshare's, where it is pid 1, or bwrap's)
ends with it, and with it all the code left. It compiles the code, then under `unshare`
hides the protected directories under empty read-only tmpfs, re-exposes the Python
installation when it sits in a directory the throw-away uid could not enter (e.g. /root),
and remounts every mount read-only except the scratch directory (bwrap does all this
itself, before the runner starts). It then forks the worker, which sets rlimits, drops
privileges (a throw-away uid when root, a nested user namespace otherwise), sets no_new_privs,
installs an audit hook (second layer; the only file/network guard in `audit` mode),
and execs the code as `__main__` in the scratch directory.

Exit status: the worker's (0 ok, 1 the code raised, or an `EXIT_*` code), or 128 + the
signal that killed it (SIGXCPU at the CPU limit).
"""

import builtins
import ctypes
import errno
import json
import linecache
import os
import re
import resource
import stat
import sys
import traceback

EXIT_SYNTAX = 241  # the code does not compile
EXIT_MEMORY = 242  # MemoryError: the address-space limit was hit
EXIT_NPROC = 243  # fork/spawn refused: the process-count limit was hit
EXIT_SETUP = 244  # the sandbox could not be set up; the code did not run

CODE_NAME = "<tool code>"
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
# statvfs f_flag bit -> mount flag to keep on remount (flags locked by the kernel must be kept)
KEEP_FLAGS = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}
CLONE_NEWUSER = 0x10000000
PR_SET_NO_NEW_PRIVS = 38
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_READ_EVENTS = {"open", "os.listdir", "os.scandir"}  # refused under protected dirs
# audit events that change the file system: refused outside the scratch directory
PATH_WRITE_EVENTS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.chmod",
                     "os.chown", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "os.mkfifo",
                     "os.mknod", "os.setxattr", "os.removexattr"}
# refused only in `audit` mode (no isolation): ways around an audit hook (new programs, raw memory)
STRICT_PREFIXES = ("os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.", "ctypes.")


class SetupError(Exception):
    """The sandbox could not be put in place."""


_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _mount(src, target: str, fstype, flags: int, data=None) -> None:
    enc = [x.encode() if isinstance(x, str) else x for x in (src, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def inside(path: str, root: str) -> bool:
    """`path` is `root` or below it (both resolved)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            raw = line.split()[4]  # space, tab, newline and backslash come as octal escapes (\040)
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), raw))
    return points


def closed_ancestor(path: str) -> str | None:
    """The outermost directory on `path` that other users may not enter, if any."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        d = "/" + "/".join(parts[:i])
        try:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return d
        except FileNotFoundError:
            return None  # made later, with the usual 0755
    return None


def expose(paths: list[str]) -> None:
    """Keep `paths` reachable for another uid: hide each closed ancestor under a tmpfs and
    bind the path back at the same place (whatever else the ancestor held stays hidden)."""
    fds, hide = {}, set()
    for p in paths:
        closed = closed_ancestor(p) if os.path.isdir(p) else None
        if closed:
            fds[p] = os.open(p, os.O_PATH | os.O_DIRECTORY)
            hide.add(closed)
    for d in sorted(hide):
        _mount("none", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
    for p, fd in fds.items():
        os.makedirs(p, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
        os.close(fd)


def confine_mounts(s: dict) -> None:
    """Hide protected dirs, bind scratch onto itself, make every other mount read-only."""
    for d in s["protected"]:
        if os.path.isdir(d):
            _mount("none", d, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=000")
    if s["uid"] is not None:
        expose([*s["expose"], s["scratch"]])
    _mount(s["scratch"], s["scratch"], None, MS_BIND)
    for point in _mount_points():
        if point in (s["scratch"], "/proc"):  # this pid namespace's proc: the worker writes its uid_map there
            continue
        try:
            flags = os.statvfs(point).f_flag
        except OSError:
            continue  # shadowed by a later mount or gone: not reachable anyway
        keep = sum(m for bit, m in KEEP_FLAGS.items() if flags & bit)
        ret = _libc.mount(None, point.encode(), None, ctypes.c_ulong(MS_REMOUNT | MS_BIND | MS_RDONLY | keep), None)
        if ret != 0 and not os.statvfs(point).f_flag & os.ST_RDONLY and not point.startswith(("/proc/", "/sys/")):
            raise SetupError(f"cannot make {point} read-only: {os.strerror(ctypes.get_errno())}")


def set_limits(s: dict) -> None:
    """Per-process limits; the CPU one signals SIGXCPU at `cpu_s` and kills one second later."""
    limits = {resource.RLIMIT_CPU: (s["cpu_s"], s["cpu_s"] + 1), resource.RLIMIT_AS: s["memory_bytes"],
              resource.RLIMIT_FSIZE: s["file_bytes"], resource.RLIMIT_NOFILE: 256, resource.RLIMIT_CORE: 0}
    for what, value in limits.items():
        resource.setrlimit(what, value if isinstance(value, tuple) else (value, value))


def _processes_of(uid: int) -> int:
    count = 0
    for name in os.listdir("/proc"):
        try:
            count += name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid
        except OSError:
            pass
    return count


def drop_privileges(s: dict) -> None:
    """No capability survives: a throw-away uid when root, else a nested user namespace.
    RLIMIT_NPROC counts processes per (user namespace, uid), and not at all for real root."""
    nproc = s["max_processes"]
    if s["uid"] is not None and os.getuid() == 0:
        os.setgroups([])
        os.setresgid(s["uid"], s["uid"], s["uid"])
        os.setresuid(s["uid"], s["uid"], s["uid"])
    elif s["userns"]:
        _check(_libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
        for name, text in (("setgroups", "deny"), ("uid_map", "0 0 1"), ("gid_map", "0 0 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    else:  # the uid is shared with the user's other processes: allow those too
        nproc += _processes_of(os.getuid())
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")


def make_audit_hook(s: dict):
    """Refuse sockets, writes outside scratch, reads of protected dirs (and, strict, escapes)."""
    scratch, protected, strict = s["scratch"], s["protected"], s["strict"]
    no_fork = strict and os.getuid() == 0  # real root ignores RLIMIT_NPROC: nothing else would stop a fork bomb

    def hook(event: str, args: tuple) -> None:
        if event.startswith("socket."):
            raise PermissionError(errno.EACCES, f"network access is disabled in this sandbox ({event})")
        if no_fork and event in ("os.fork", "os.forkpty"):
            raise PermissionError(errno.EAGAIN, "fork is disabled in this sandbox (audit mode as root)")
        if strict and event.startswith(STRICT_PREFIXES):
            raise PermissionError(errno.EACCES, f"{event} is disabled in this sandbox (audit mode)")
        if (event in PATH_READ_EVENTS or event in PATH_WRITE_EVENTS) and args and isinstance(args[0], (str, bytes)):
            path = os.path.realpath(os.fsdecode(args[0]))
            if any(inside(path, d) for d in protected):
                raise PermissionError(errno.EACCES, f"{path}: protected directory")
            writes = event in PATH_WRITE_EVENTS or (event == "open" and (
                (isinstance(args[2], int) and args[2] & WRITE_FLAGS)
                or (isinstance(args[1], str) and any(c in args[1] for c in "wax+"))))
            if writes and not inside(path, scratch):
                raise PermissionError(errno.EROFS, f"{path}: only the scratch directory is writable")

    return hook


def run_code(compiled) -> int:
    """Exec as `__main__`; report an exception the way python would, minus this file's frames."""
    try:
        exec(compiled, {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException as exc:  # noqa: BLE001 - everything the code raises is reported to the model
        try:  # the model's frames only: not the exec here, nor the audit hook that refused a call
            report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
            report.stack = traceback.StackSummary.from_list([f for f in report.stack if f.filename != __file__])
            print("".join(report.format()), end="", file=sys.stderr)
        except MemoryError:
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        if isinstance(exc, MemoryError):
            return EXIT_MEMORY
        return EXIT_NPROC if isinstance(exc, BlockingIOError) and exc.errno == errno.EAGAIN else 1
    return 0


def worker(s: dict, compiled) -> int:
    """The forked process that runs the code (never returns into the supervisor)."""
    try:
        set_limits(s)
        drop_privileges(s)
        os.chdir(s["scratch"])  # as the code's uid: under bwrap, root has no capability to enter it
    except (SetupError, OSError) as exc:
        print(f"sandbox setup failed: {exc}", file=sys.stderr)
        return EXIT_SETUP
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    sys.addaudithook(make_audit_hook(s))
    return run_code(compiled)


def supervise(child: int) -> int:
    """Reap children (under unshare, as pid 1, orphans too) until the worker ends; its status."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return EXIT_SETUP
        if pid == child:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def main() -> int:
    s = json.loads(sys.argv[1])
    code = sys.stdin.read()
    try:
        compiled = compile(code, CODE_NAME, "exec")
    except (SyntaxError, ValueError) as exc:
        print("".join(traceback.format_exception_only(type(exc), exc)).rstrip(), file=sys.stderr)
        return EXIT_SYNTAX
    linecache.cache[CODE_NAME] = (len(code), None, code.splitlines(True), CODE_NAME)
    try:
        if s["namespaces"]:
            confine_mounts(s)
    except (SetupError, OSError) as exc:
        print(f"sandbox setup failed: {exc}", file=sys.stderr)
        return EXIT_SETUP
    sys.stdout.flush()
    child = os.fork()
    if child == 0:
        status = 1
        try:
            status = worker(s, compiled)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:  # noqa: BLE001 - a closed pipe must not keep the worker alive
                    pass
            os._exit(status)
    return supervise(child)


if __name__ == "__main__":
    sys.exit(main())
