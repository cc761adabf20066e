"""Units in worker processes (`zerosafe.run.workers`): the same bytes as threads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import SAMPLE_CKPT
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.errors import ConfigError
from zerosafe.run.workers import PROCESS_MIN_BYTES, process_options


def _weights(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


def test_processes_write_the_bytes_threads_write(tmp_path: Path, monkeypatch) -> None:
    import zerosafe.run.local as local
    from zerosafe.run.workers import UnitPool

    pools: list[int] = []

    class CountedPool(UnitPool):  # the real pool, counted: the processes path did run
        def __init__(self, workers: int, shared: dict | None = None, **kw: bool) -> None:
            pools.append(workers)
            super().__init__(workers, shared, **kw)

    monkeypatch.setattr(local, "UnitPool", CountedPool)
    options = ConvertOptions(dtype="bf16", max_shard_size=4096, direct=True)
    outs = {}
    for mode in ("threads", "processes"):
        outs[mode] = tmp_path / mode
        summary = convert_checkpoint(str(SAMPLE_CKPT), str(outs[mode]), options, workers=mode)
        assert summary.status == "converted"
    weights = _weights(outs["threads"])
    assert len(weights) >= 2
    assert _weights(outs["processes"]) == weights
    assert pools == [2]


def test_process_options_divides_the_budget() -> None:
    options = ConvertOptions(memory=2 * 10**9, max_parallel_tasks=2)
    enough = {"units": 4, "nbytes": PROCESS_MIN_BYTES}
    assert process_options(options, **enough, mode="threads") is None
    assert process_options(options, units=4, nbytes=PROCESS_MIN_BYTES - 1, mode="auto") is None
    assert process_options(options, units=1, nbytes=PROCESS_MIN_BYTES, mode="auto") is None
    chosen = process_options(options, **enough, mode="auto")
    assert chosen is not None and chosen.parallel_tasks == 2
    assert chosen.memory < options.memory
    small = process_options(options, units=4, nbytes=1, mode="processes")  # no size test
    assert small is not None and small.parallel_tasks == 2
    eight = ConvertOptions(memory=10**9, max_parallel_tasks=8)  # 1 GB holds 2 workers
    fewer = process_options(eight, **enough, mode="auto")
    assert fewer is not None and fewer.parallel_tasks == 2 and fewer.memory <= eight.memory
    assert process_options(ConvertOptions(memory=300 * 2**20), **enough, mode="auto") is None
    one_task = ConvertOptions(memory=2 * 10**9, max_parallel_tasks=1)
    assert process_options(one_task, **enough, mode="processes") is None
    with pytest.raises(ConfigError):
        process_options(options, **enough, mode="bogus")


def test_run_settings_read_the_environment_only_when_asked(monkeypatch) -> None:
    """`ZEROSAFE_WORKERS`/`ZEROSAFE_COPY` are read where a run starts (the command, the flow),
    never inside the engine; a bad value is one clear line."""
    from zerosafe.run.job import RunSettings

    assert RunSettings() == RunSettings(workers="threads", copy="auto")  # a library call
    assert RunSettings.from_environ({}, workers="auto").workers == "auto"  # the command's
    got = RunSettings.from_environ({"ZEROSAFE_WORKERS": "Threads", "ZEROSAFE_COPY": "fused"})
    assert got == RunSettings(workers="threads", copy="fused")
    with pytest.raises(ConfigError, match="ZEROSAFE_WORKERS='bogus'"):
        RunSettings.from_environ({"ZEROSAFE_WORKERS": "bogus"})
    with pytest.raises(ConfigError, match="ZEROSAFE_COPY='fast': expected one of auto, fused"):
        RunSettings.from_environ({"ZEROSAFE_COPY": "fast"})


def test_the_command_takes_processes_by_default_and_says_so(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """The command runs a big enough job in worker processes by default (the size floor is
    lowered so that the sample counts) and the summary says so; `ZEROSAFE_WORKERS=threads`
    keeps threads, and so does a library call unless asked (the engine reads no environment
    variable: a library call keeps threads even with `ZEROSAFE_WORKERS` set). Same bytes
    every way."""
    import zerosafe.run.local as local
    import zerosafe.run.workers as workers
    from zerosafe.run.workers import UnitPool
    from zerosafe_app.cli import main

    pools: list[int] = []

    class CountedPool(UnitPool):
        def __init__(self, n: int, shared: dict | None = None, **kw: bool) -> None:
            pools.append(n)
            super().__init__(n, shared, **kw)

    monkeypatch.setattr(local, "UnitPool", CountedPool)
    monkeypatch.setattr(workers, "PROCESS_MIN_BYTES", 1)
    monkeypatch.setenv("ZEROSAFE_WORKERS", "processes")
    options = ConvertOptions(dtype="bf16", max_shard_size=4096, direct=True)
    convert_checkpoint(str(SAMPLE_CKPT), str(tmp_path / "library"), options)
    monkeypatch.delenv("ZEROSAFE_WORKERS")
    assert pools == []
    argv = ["convert", str(SAMPLE_CKPT), str(tmp_path / "command"), "--dtype", "bf16",
            "--max-shard-size", "4096", "--mode", "direct", "--parallel", "2"]  # fmt: skip
    assert main(argv) == 0
    assert pools == [2]
    assert "units ran in 2 worker processes" in capsys.readouterr().out
    monkeypatch.setenv("ZEROSAFE_WORKERS", "threads")
    assert main([*argv[:2], str(tmp_path / "threads"), *argv[3:]]) == 0
    assert pools == [2]
    assert "worker processes" not in capsys.readouterr().out
    assert _weights(tmp_path / "threads") == _weights(tmp_path / "library")
    assert _weights(tmp_path / "command") == _weights(tmp_path / "library")


def test_workers_started_inside_a_checkpoint_folder_import_nothing_from_it(
    tmp_path: Path,
) -> None:
    """`zerosafe convert . out` run from inside the checkpoint's folder: the workers'
    interpreters start with `python -c`, which would put that folder first on their module
    path, so a `numpy/` (or `zerosafe/`) package in it would run in them; it must not."""
    folder = tmp_path / "ckpt"
    shutil.copytree(SAMPLE_CKPT, folder)
    ran = tmp_path / "ran"
    for name in ("numpy", "zerosafe", "multiprocessing"):
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(
            f"open({str(ran)!r}, 'a').write({name + ' '!r})\nraise ImportError('not this one')\n"
        )
    command = [str(Path(sys.executable).parent / "zerosafe"), "convert", ".", str(tmp_path / "out"),
               "--dtype", "bf16", "--max-shard-size", "4096", "--mode", "direct", "--parallel", "2"]  # fmt: skip
    done = subprocess.run(
        command, cwd=folder, env={**os.environ, "ZEROSAFE_WORKERS": "processes"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "units ran in 2 worker processes" in done.stdout
    assert not ran.exists(), f"imported from the checkpoint's folder: {ran.read_text()}"
    # A pool started with no prestart (the flow's tasks) starts the forkserver itself.
    (tmp_path / "runner").mkdir()
    (tmp_path / "runner" / "pool.py").write_text(
        "import os, pkgutil, zerosafe\nfrom zerosafe.run.workers import UnitPool\n"
        "if __name__ == '__main__':\n    with UnitPool(2) as pool:\n        pool.start()\n"
        "        assert pool.run(os.getpid) in pool.pids\n"
        "        assert pool.run(pkgutil.resolve_name, 'zerosafe:__file__') == zerosafe.__file__\n"
        "        assert 'PYTHONSAFEPATH' not in os.environ\n"
    )
    done = subprocess.run(
        [sys.executable, str(tmp_path / "runner" / "pool.py")], cwd=folder,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert not ran.exists(), f"imported from the checkpoint's folder: {ran.read_text()}"


def test_an_installed_engine_adds_nothing_to_the_workers_path(monkeypatch) -> None:
    """Workers get the caller's engine folder first on their path only where the interpreter
    would not search it anyway: put first, its own package folder could shadow the standard
    library in them."""
    import sysconfig

    import zerosafe
    from zerosafe.run import workers

    checkout = os.path.dirname(os.path.dirname(os.path.realpath(zerosafe.__file__)))
    assert workers._engine_folder() == checkout  # this checkout, installed editable
    purelib = sysconfig.get_path("purelib")
    monkeypatch.setattr(zerosafe, "__file__", os.path.join(purelib, "zerosafe", "__init__.py"))
    assert workers._engine_folder() is None
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with workers._interpreters_without_current_folder():
        assert os.environ["PYTHONSAFEPATH"] == "1" and "PYTHONPATH" not in os.environ
    assert "PYTHONSAFEPATH" not in os.environ


def test_on_python_3_10_a_folder_of_modules_keeps_the_units_in_threads(
    tmp_path: Path, monkeypatch
) -> None:
    """Python 3.10 has no PYTHONSAFEPATH: there, a current folder holding modules keeps the
    units in threads (`auto`), or is refused with the fix (`processes`)."""
    from zerosafe.run import workers

    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text("")
    (tmp_path / "data").mkdir()  # a folder without __init__.py is no package
    (tmp_path / "helper.py").write_text("")
    (tmp_path / "weights.bin").write_text("")
    assert workers.modules_in(str(tmp_path)) == ["helper.py", "numpy"]
    monkeypatch.chdir(tmp_path)
    options = ConvertOptions(max_parallel_tasks=4)
    assert process_options(options, units=4, nbytes=PROCESS_MIN_BYTES, mode="auto") is not None
    monkeypatch.setattr(workers.sys, "version_info", (3, 10, 14))
    assert process_options(options, units=4, nbytes=PROCESS_MIN_BYTES, mode="auto") is None
    with pytest.raises(ConfigError, match="helper.py, numpy.*run from another folder"):
        process_options(options, units=4, nbytes=PROCESS_MIN_BYTES, mode="processes")
    (tmp_path / "helper.py").unlink()
    shutil.rmtree(tmp_path / "numpy")
    assert process_options(options, units=4, nbytes=PROCESS_MIN_BYTES, mode="auto") is not None


def test_parallel_defaults_to_half_the_cores(monkeypatch) -> None:
    from zerosafe_app import cli

    for cores, expected in ((1, 2), (2, 2), (6, 3), (16, 4), (64, 4)):
        monkeypatch.setattr(cli.os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert cli.default_parallel() == expected


def test_more_than_two_tasks_merge_at_once_as_threads(tmp_path: Path, monkeypatch) -> None:
    """With `--parallel` above 2 the in-process run merges that many shards at once as threads
    (each then verified by the same thread), not one merge with a verify beside it: the first
    two merges meet at a barrier, which a serial run would never reach. Same bytes as 2 tasks."""
    import dataclasses
    import threading

    import zerosafe.run.local as local

    barrier = threading.Barrier(2, timeout=60)
    calls: list[str] = []
    real_merge = local.merge_unit

    def merge_meeting_another(*args, **kwargs):  # the real merge, after meeting a second one
        calls.append(threading.current_thread().name)
        if len(calls) <= 2:
            barrier.wait()
        return real_merge(*args, **kwargs)

    base = ConvertOptions(dtype="bf16", max_shard_size=4096, direct=True, memory=2 * 10**9)
    two = convert_checkpoint(str(SAMPLE_CKPT), str(tmp_path / "two"), base)
    monkeypatch.setattr(local, "merge_unit", merge_meeting_another)
    four = dataclasses.replace(base, max_parallel_tasks=4)
    summary = convert_checkpoint(str(SAMPLE_CKPT), str(tmp_path / "four"), four)
    assert summary.status == two.status == "converted"
    assert len(calls) >= 3 and all(name.startswith("zerosafe-unit") for name in calls)
    assert _weights(tmp_path / "four") == _weights(tmp_path / "two")


def test_prestart_starts_the_forkserver_only_where_processes_may_run() -> None:
    import subprocess
    import sys

    # In a fresh interpreter: this one's forkserver may already run for the tests above.
    code = (
        "import sys\n"
        "from multiprocessing import forkserver\n"
        "from zerosafe.run import workers\n"
        "workers.usable_cores = lambda: int(sys.argv[2])\n"
        "started = workers.prestart(sys.argv[1])\n"
        "print(started, forkserver._forkserver._forkserver_pid is not None)\n"
    )
    seen = {}
    for mode, cores in (("threads", 16), ("auto", 2), ("auto", 16), ("processes", 2)):
        run = subprocess.run(
            [sys.executable, "-c", code, mode, str(cores)],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        seen[mode, cores] = run.stdout.split()
    assert seen == {
        ("threads", 16): ["False", "False"],
        ("auto", 2): ["False", "False"],
        ("auto", 16): ["True", "True"],
        ("processes", 2): ["True", "True"],
    }


def test_workers_die_with_a_killed_command(tmp_path: Path) -> None:
    """SIGKILL to the process that runs a pool: its worker, busy with a long unit, is killed
    too (it would otherwise finish its unit, writing after the command is gone)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "pool.py"
    script.write_text(
        "import os, time\n"
        "from zerosafe.run.workers import UnitPool\n"
        "if __name__ == '__main__':\n"
        "    pool = UnitPool(1)\n"
        "    print(pool.run(os.getpid), flush=True)\n"
        "    pool.run(time.sleep, 120)\n"
    )
    run = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout is not None
        worker = int(run.stdout.readline())
        time.sleep(0.5)  # the worker is in its sleep
        os.kill(worker, 0)  # alive
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        raise AssertionError(f"worker {worker} outlived the killed command by 30 s")
    finally:
        run.kill()


def _pid() -> int:
    return os.getpid()


def test_start_brings_every_worker_up_before_the_units() -> None:
    """`start` forks all the workers at once (the executor would fork one per submit, while
    the other submits wait)."""
    import threading

    from zerosafe.run.workers import UnitPool

    with UnitPool(3) as pool:
        pool.start()
        assert len(pool.pids) == 3 and os.getpid() not in pool.pids
        barrier = threading.Barrier(3)

        def call(_: int) -> int:
            barrier.wait()
            return pool.run(_pid)

        with ThreadPoolExecutor(3) as callers:
            got = list(callers.map(call, range(3)))
        assert set(got) <= pool.pids  # no worker forked after start
