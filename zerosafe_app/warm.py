"""A pre-imported process beside the local Prefect server, so `zerosafe convert` does not pay
its imports on every run.

A `zerosafe convert` spends about 2.5 s importing Prefect and torch before it reads a byte
(measured with py-spy on this project's machines); on a 0.5B checkpoint that is as long as the
conversion. The local server already outlives a command (`zerosafe_app.flows.runtime`); so does this
*warm* process. A command that ran in-process starts one as it exits (`start_warm`, detached,
with the command's own environment and the server's URL, which Prefect reads at import): it
imports what a conversion imports, runs no thread of its own, and waits on a socket. A later
command (`run_warm`, called by the `zerosafe` entry point before anything heavy is imported)
sends it its arguments, working folder, environment, CPU affinity, limits and its standard
streams (as file descriptors); the warm process forks a child, which takes all of those on and
runs the ordinary command line (`zerosafe_app.cli.main`) there: the same code path, flow
included, only without the imports. The command waits for the child's exit status and exits
with it. The warm process ends when the server's keeper does (idle for
`ZEROSAFE_SERVER_IDLE_SECONDS`, 600 by default) or the server moves to another address.

What stays true of a command served this way:
- Ctrl-C (SIGINT), SIGTERM and SIGHUP sent to the command are passed on to the child, which
  stops as an in-process run would ("interrupted; run the same command again to resume").
- A command killed outright (SIGKILL) takes its child with it: the warm process kills the
  child's process group when the command's end of the socket closes, and, before serving the
  next command, kills and reaps the child of any command that is gone, so a resumed run never
  races the run it replaces.
- Only the same code and settings are served: a command sends a key of its interpreter, the
  installed packages, zerosafe's source files and the environment variables read at import
  (`PREFECT_*`, `PYTHON*`, `OMP_*`/`MKL_*`/`TORCH_*`, `ZEROSAFE_*`); a warm process started
  with another key refuses, and the command runs in-process (one whose own code changed since
  it started, after an upgrade or an edit, then ends, so that command starts a fresh one as it
  exits). So does a command with `-v`
  (Prefect's log level is read at import), `--no-flow`, a `PREFECT_API_URL` of its own, or
  `ZEROSAFE_WARM=0`.
- Only the same user: the warm process checks its peer's uid (SO_PEERCRED).

`ZEROSAFE_WARM=0` turns it off. Its memory is what a conversion's imports take (about 0.3 GB
resident, shared with the children it forks). The benchmark counts the
child's memory, CPU and I/O in the command's own figures (`ZEROSAFE_WARM_STATS`).
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import os
import signal
import socket
import struct
import sys
from pathlib import Path
from typing import Any

__all__ = ["environment_key", "run_warm", "serve", "socket_address", "warm_enabled"]

_HEADER = struct.Struct("!I")
_KEYED_PREFIXES = ("PREFECT_", "PYTHON", "OMP_", "MKL_", "TORCH_", "ZEROSAFE_", "KMP_")
_UNKEYED = frozenset({"PREFECT_API_URL", "ZEROSAFE_WARM_STATS", "ZEROSAFE_SERVER_IDLE_SECONDS"})
EMBEDDED_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_LOGGING_LEVEL": "CRITICAL",
    "PREFECT_LOGGING_LOGGERS_PREFECT_LEVEL": "CRITICAL",
}
"""What `configure_embedded_prefect(verbose=0)` sets where the user did not: part of the key."""
PRELOAD = (
    "torch",
    "zerosafe_app.cli",
    "zerosafe_app.flows.convert",
    "zerosafe_app.pt2st_cli",
    "zerosafe_app.lazify_cli",
    "zerosafe.pipeline",
    "zerosafe.formats.registry",
    "zerosafe.stages.clean",
    "prefect.engine",
    "prefect.flow_engine",
    "prefect.task_engine",
    "prefect.concurrency.sync",
    "prefect.utilities.visualization",
    "fastapi",
    "safetensors",
    "xxhash",
)
"""What the warm process imports: what a `zerosafe convert` imports, but pyarrow (its
allocator starts a thread at import; the warm process forks, so it runs none of its own)."""
LOCK_NAME = "zerosafe-warm.lock"
_THREADS_AT_START = 1
_STALE = False
"""Set once the installed code no longer matches what this warm process imported: it stops
serving (its children finish) and releases the lock, so the next command starts a new one."""
_LOCK_FD: int | None = None
"""The warm process's hold on `LOCK_NAME` (its children close their copy)."""
_LIMITS = ("RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_NOFILE", "RLIMIT_CORE")


def prefect_home(env: dict[str, str] | os._Environ[str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()


def socket_address(home: Path) -> bytes:
    """The warm process's socket: an abstract address (no file to clean up, no path-length
    limit), one per `PREFECT_HOME`."""
    digest = hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:24]
    return b"\0zerosafe-warm-" + digest.encode()


def _keyed(env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    keyed = dict(EMBEDDED_DEFAULTS)
    keyed.update(
        (k, v) for k, v in env.items() if k.startswith(_KEYED_PREFIXES) and k not in _UNKEYED
    )
    return keyed


def _code_fingerprint() -> list[Any]:
    """The installed packages and zerosafe's own sources, by name, size and mtime: a change to
    any of them (an upgrade, an edit) makes a new key."""
    out: list[Any] = [sys.executable, sys.version]
    here = Path(__file__).resolve().parent
    for root in (here, here.parent / "zerosafe"):
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    st = os.stat(os.path.join(folder, name))
                    out.append([os.path.join(folder, name), st.st_size, st.st_mtime_ns])
    for entry in sys.path:
        if entry.endswith("site-packages") and os.path.isdir(entry):
            out.append(sorted(n for n in os.listdir(entry) if n.endswith(".dist-info")))
    return out


def environment_key(env: dict[str, str] | os._Environ[str] | None = None) -> str:
    """What must match between a command and the warm process that serves it."""
    env = os.environ if env is None else env
    blob = json.dumps([sorted(_keyed(env).items()), _code_fingerprint()])
    return hashlib.sha256(blob.encode()).hexdigest()


def warm_enabled(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether commands may use (and keepers start) a warm process."""
    env = os.environ if env is None else env
    if env.get("ZEROSAFE_WARM", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if env.get("PREFECT_API_URL"):
        return False
    try:
        return float(env.get("ZEROSAFE_SERVER_IDLE_SECONDS", "1")) > 0
    except ValueError:
        return True


def _servable(argv: list[str]) -> bool:
    """A `zerosafe convert` with the flow, at the default verbosity."""
    if not argv or argv[0] != "convert":
        return False
    for arg in argv[1:]:
        if arg == "--":
            break
        if arg in ("--no-flow", "--verbose", "-h", "--help") or (
            arg.startswith("-v") and set(arg[1:]) == {"v"}
        ):
            return False
    return True


# --- wire format: a 4-byte length, then JSON -------------------------------------------------


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    data = _HEADER.pack(len(data)) + data
    if fds:
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sent = sock.sendmsg([data], rights)
        sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def _recv_exact(sock: socket.socket, size: int, fds: list[int] | None = None) -> bytes:
    chunks, got = [], 0
    while got < size:
        if fds is not None and not got:
            space = socket.CMSG_SPACE(16 * array.array("i").itemsize)
            data, ancillary, _flags, _addr = sock.recvmsg(size, space)
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received = array.array("i")
                    received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
                    fds.extend(received)
        else:
            data = sock.recv(size - got)
        if not data:
            raise EOFError
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def _recv(sock: socket.socket, fds: list[int] | None = None) -> dict[str, Any]:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, fds))
    if size > 16 * 2**20:
        raise EOFError
    message = json.loads(_recv_exact(sock, size))
    if not isinstance(message, dict):
        raise EOFError
    return message


# --- the command's side ----------------------------------------------------------------------


def run_warm(argv: list[str]) -> int | None:
    """Have the warm process run this command; its exit code, or None to run it here.

    None when the command is not one a warm process serves, no warm process is up, or the one
    up has another key (see the module docstring). Costs a few milliseconds when it says None.
    """
    if not _servable(argv) or not warm_enabled():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(2.0)
        sock.connect(socket_address(prefect_home()))
        limits = {}
        import resource

        for name in _LIMITS:
            limits[name] = list(resource.getrlimit(getattr(resource, name)))
        umask = os.umask(0)
        os.umask(umask)
        request = {
            "key": environment_key(),
            "argv": argv,
            "cwd": os.getcwd(),
            "env": dict(os.environ),
            "umask": umask,
            "affinity": sorted(os.sched_getaffinity(0)),
            "limits": limits,
        }
        _send(sock, request, fds=[0, 1, 2])
        reply = _recv(sock)
    except (OSError, EOFError, ValueError):
        sock.close()
        return None
    if "pid" not in reply:  # refused: another key, or not ready
        sock.close()
        return None
    child = int(reply["pid"])
    stats = os.environ.get("ZEROSAFE_WARM_STATS")
    if stats:
        with contextlib.suppress(OSError):
            Path(stats).write_text(json.dumps({"pid": child}))
    return _wait_child(sock, child)


def _wait_child(sock: socket.socket, child: int) -> int:
    def forward(signum: int, _frame: Any) -> None:
        with contextlib.suppress(OSError):
            os.kill(child, signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, forward)
    sock.settimeout(None)
    while True:
        try:
            reply = _recv(sock)
            break
        except InterruptedError:
            continue
        except (OSError, EOFError, ValueError):
            print(
                "zerosafe: error: the warm zerosafe process ended before the command did; run "
                "the same command again to resume (ZEROSAFE_WARM=0 runs it in this process).",
                file=sys.stderr,
            )
            return 2
    sock.close()
    if "signal" in reply:  # killed by a signal: end the same way, as an in-process run would
        number = int(reply["signal"])
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        return 128 + number
    return int(reply.get("exit", 1))


# --- the warm process ------------------------------------------------------------------------


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


class _Served:
    __slots__ = ("conn", "pid", "pidfd")

    def __init__(self, conn: socket.socket, pid: int, pidfd: int) -> None:
        self.conn, self.pid, self.pidfd = conn, pid, pidfd


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(OSError):
            kill(pid, signal.SIGKILL)


def _client_gone(conn: socket.socket) -> bool:
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def serve(url: str, *, check_seconds: float = 1.0) -> int:
    """The warm process: import, then serve commands for as long as the local server at `url`
    is the one this `PREFECT_HOME` records (see the module docstring)."""
    import selectors

    from zerosafe_app.flows.runtime import configure_embedded_prefect, recorded_server

    home = prefect_home()
    global _LOCK_FD
    _LOCK_FD = _hold_lock(home)
    if _LOCK_FD is None:
        return 0  # another warm process serves (or is starting for) this PREFECT_HOME
    key = environment_key()
    configure_embedded_prefect(verbose=0)
    os.environ["PREFECT_API_URL"] = url + "/api"  # Prefect reads it at import
    for module in PRELOAD:
        __import__(module)
    global _THREADS_AT_START
    _THREADS_AT_START = len(os.listdir("/proc/self/task"))  # torch starts one, idle
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(socket_address(home))
    except OSError:
        return 0  # another warm process serves this PREFECT_HOME
    listener.listen(16)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    served: dict[int, _Served] = {}  # by pidfd
    sys.stdout.flush()
    sys.stderr.flush()
    while served or (recorded_server(home) == url and not _STALE):
        for selected, _events in selector.select(timeout=check_seconds):
            if selected.fileobj is listener:
                conn, _ = listener.accept()
                _sweep(served, selector)
                entry = _accept(conn, key, url, listener, served)
                if entry is not None:
                    served[entry.pidfd] = entry
                    selector.register(entry.pidfd, selectors.EVENT_READ, entry)
                    selector.register(entry.conn, selectors.EVENT_READ, entry)
                continue
            entry = selected.data
            if not isinstance(entry, _Served) or entry.pidfd not in served:
                continue
            if selected.fileobj is entry.conn:  # the command's end: closed means it is gone
                if _client_gone(entry.conn):
                    _kill_group(entry.pid)
                    _finish(entry, served, selector)
                else:  # nothing is expected from it; drop stray bytes
                    with contextlib.suppress(OSError):
                        entry.conn.recv(4096)
            else:  # the child ended
                _finish(entry, served, selector)
    return 0


def _hold_lock(home: Path) -> int | None:
    """Take `PREFECT_HOME/zerosafe-warm.lock` (held by the warm process for its life, so only
    one starts); None when another process holds it."""
    import fcntl

    try:
        fd = os.open(home / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def start_warm(argv: list[str], env: dict[str, str]) -> None:
    """After a command that ran in-process: start a warm process for the next one, if this
    command is one it would serve, the local server is up and no warm process answers.

    `env` is the command's environment as it started (before `configure_embedded_prefect`).
    The warm process is detached (its own session) and imports after this command has exited.
    """
    if not _servable(argv) or not warm_enabled(env):
        return
    from zerosafe_app.flows.runtime import recorded_server

    home = prefect_home(env)
    url = recorded_server(home)
    if url is None:
        return
    lock = _hold_lock(home)
    if lock is None:
        return  # one is up, or starting
    os.close(lock)
    import subprocess

    log = home / "zerosafe-warm.log"
    with contextlib.suppress(OSError), open(log, "wb") as out:
        subprocess.Popen(
            [sys.executable, "-m", "zerosafe_app.warm", "serve", "--url", url],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            cwd=Path(__file__).resolve().parents[1], start_new_session=True, close_fds=True,
        )  # fmt: skip


def _sweep(served: dict[int, _Served], selector: Any) -> None:
    """Kill and reap the children of commands that are gone, before serving a new one."""
    for entry in list(served.values()):
        if _client_gone(entry.conn):
            _kill_group(entry.pid)
            _finish(entry, served, selector)


def _finish(entry: _Served, served: dict[int, _Served], selector: Any) -> None:
    """Reap the child and tell its command how it ended."""
    _, status = os.waitpid(entry.pid, 0)
    if os.WIFSIGNALED(status):
        reply = {"signal": os.WTERMSIG(status)}
    else:
        reply = {"exit": os.waitstatus_to_exitcode(status)}
    with contextlib.suppress(OSError):
        _send(entry.conn, reply)
    for fileobj in (entry.pidfd, entry.conn):
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(fileobj)
    served.pop(entry.pidfd, None)
    os.close(entry.pidfd)
    entry.conn.close()


def _accept(
    conn: socket.socket, key: str, url: str, listener: socket.socket, served: dict[int, _Served]
) -> _Served | None:
    fds: list[int] = []
    try:
        conn.settimeout(5.0)
        if _peer_uid(conn) != os.getuid():
            conn.close()
            return None
        request = _recv(conn, fds)
        if request.get("key") != key or len(fds) != 3:
            _send(conn, {"refused": "another key"})
            conn.close()
            if environment_key() != key:  # our own code changed (an upgrade, an edit): make way
                global _STALE
                _STALE = True
            return None
        if len(os.listdir("/proc/self/task")) > _THREADS_AT_START:  # none of ours may run
            _send(conn, {"refused": "threads"})
            conn.close()
            return None
        from zerosafe_app.flows.runtime import server_healthy

        if not server_healthy(url):  # Prefect here talks to `url` only (read at import)
            _send(conn, {"refused": "server down"})
            conn.close()
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            listener.close()
            for entry in served.values():
                entry.conn.close()
                os.close(entry.pidfd)
            _child(conn, request, fds)
        conn.settimeout(None)
        _send(conn, {"pid": pid})
        return _Served(conn, pid, os.pidfd_open(pid))
    except (OSError, EOFError, ValueError):
        conn.close()
        return None
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _child(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """Become the command: its streams, folder, environment, affinity and limits; then run it."""
    code = 1
    try:
        os.setsid()  # its own process group, so killing it takes what it started
        if _LOCK_FD is not None:
            os.close(_LOCK_FD)
        _die_with_parent()
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        fds.clear()
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.umask(int(request["umask"]))
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, request["affinity"])
        import resource

        for name, (soft, hard) in request["limits"].items():
            with contextlib.suppress(ValueError, OSError, AttributeError):
                resource.setrlimit(getattr(resource, name), (soft, hard))
        sys.argv = ["zerosafe", *request["argv"]]
        with contextlib.suppress(Exception):
            sys.stdout.reconfigure(line_buffering=sys.stdout.isatty())  # type: ignore[union-attr]
            sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        from zerosafe_app.cli import finish_process, main

        code = main(request["argv"])
        _write_stats()
        finish_process(code)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except KeyboardInterrupt:  # before `main` caught it (still importing): as `main` says it
        from zerosafe_app.cli import EXIT_INTERRUPTED, INTERRUPTED

        print(INTERRUPTED, file=sys.stderr)
        code = EXIT_INTERRUPTED
    except BaseException:
        import traceback

        with contextlib.suppress(Exception):
            traceback.print_exc()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _write_stats() -> None:
    """For the benchmark: this child's CPU seconds and I/O counts, which its command's process
    tree does not include (`ZEROSAFE_WARM_STATS`)."""
    path = os.environ.get("ZEROSAFE_WARM_STATS")
    if not path:
        return
    times = os.times()
    stats: dict[str, Any] = {"pid": os.getpid(), "cpu_s": sum(times[:4])}
    with contextlib.suppress(OSError), open("/proc/self/io") as f:
        stats["io"] = {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}
    with contextlib.suppress(OSError):
        Path(path + ".child").write_text(json.dumps(stats))


def _die_with_parent() -> None:
    import ctypes
    import ctypes.util

    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed with the warm process


def _main() -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m zerosafe_app.warm")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="import, then serve commands (started by a command)")
    s.add_argument("--url", required=True, help="the local Prefect server's URL")
    return serve(parser.parse_args().url)


if __name__ == "__main__":
    sys.exit(_main())
