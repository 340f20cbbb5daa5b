"""The C++ kernels' build: one killed midway never blocks the next (nanopaged/cpu/build.py:
`locked_load`), and a failed one stops the test session once (tests/conftest.py). torch's builder
marks a build with a `lock` file and waits for that file to vanish; a build killed while it compiles
leaves the file behind. The tests build a one-function library through the same `locked_load` the
kernels use, in a folder of their own, with a compiler stand-in that hangs while it compiles, so the
kill lands mid-build every time."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanopaged.cpu.build import missing_tools

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 240          # a load on a busy 2-core machine (Python, torch, a one-line compile) fits well within
PROGRAM = """
import ctypes, sys
from pathlib import Path
from nanopaged.cpu.build import locked_load
folder = Path(sys.argv[1])
path = locked_load("answer", folder, sources=[str(folder / "answer.cpp")], is_python_module=False)
print(ctypes.CDLL(path).answer())
"""

pytestmark = pytest.mark.skipif(missing_tools() is not None, reason=f"building needs {missing_tools()}")


@pytest.fixture
def folder(tmp_path):
    folder = tmp_path / "build"
    folder.mkdir()
    (folder / "answer.cpp").write_text('extern "C" int answer() { return 42; }\n')
    return folder


def build_process(folder: Path, hang: bool) -> dict:
    """Popen / run arguments for a process that builds `folder`'s library; with `hang`, its compiler
    never returns (it touches `compiling` beside the folder first, and leaves its pid in `compiler.pid`:
    ninja starts it in a process group of its own, which killing the builder's group does not reach),
    as a build stopped midway."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if hang:
        compiler = folder.parent / "hanging-c++"
        compiler.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) echo $$ > "{folder.parent / "compiler.pid"}"; '
                            f'touch "{folder.parent / "compiling"}"; exec sleep 600;; esac\nexec c++ "$@"\n')
        compiler.chmod(0o755)
        env["CXX"] = str(compiler)
    return dict(args=[sys.executable, "-c", PROGRAM, str(folder)], env=env, cwd=ROOT, text=True,
                start_new_session=True)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {HANG_GUARD_S} s"
        time.sleep(0.1)


def kill_mid_build(folder: Path, hung: subprocess.Popen) -> None:
    """SIGKILL to the builder and its compiler once it compiles, as a stopped first start does."""
    try:
        wait_for(lambda: (folder.parent / "compiling").exists(), "compile started")
    finally:
        os.killpg(hung.pid, signal.SIGKILL)
        hung.wait()
        kill_stand_in(folder)


def kill_stand_in(folder: Path) -> None:
    """The hanging compiler outlives its builder (its own process group): no test leaves it sleeping."""
    try:
        os.kill(int((folder.parent / "compiler.pid").read_text()), signal.SIGKILL)
    except (OSError, ValueError):
        pass                         # it never started, or is gone already


def test_a_build_killed_while_it_compiles_leaves_nothing_the_next_build_waits_on(folder):
    hung = subprocess.Popen(**build_process(folder, hang=True))
    kill_mid_build(folder, hung)
    assert (folder / "lock").exists()              # torch's marker, left behind: what used to block for good
    done = subprocess.run(**build_process(folder, hang=False), capture_output=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["42"]
    assert not (folder / "lock").exists()


def test_a_second_build_says_it_waits_and_goes_on_when_the_first_dies(folder, tmp_path):
    hung = subprocess.Popen(**build_process(folder, hang=True))
    stderr = tmp_path / "second.stderr"
    second = None
    try:
        wait_for(lambda: (folder.parent / "compiling").exists(), "compile started")
        with stderr.open("w") as log:
            second = subprocess.Popen(**build_process(folder, hang=False), stdout=subprocess.PIPE, stderr=log)
        wait_for(lambda: "waiting for another build" in stderr.read_text(), "line saying it waits")
        assert second.poll() is None                   # it waits while the first holds the lock
        os.killpg(hung.pid, signal.SIGKILL)
        out, _ = second.communicate(timeout=HANG_GUARD_S)
        assert second.returncode == 0, stderr.read_text()[-3000:]
        assert out.split() == ["42"]
    finally:
        for proc in (hung, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        kill_stand_in(folder)


def test_a_failed_build_stops_the_test_session_once_with_the_compiler_output(tmp_path):
    """tests/conftest.py builds the kernels once before the first test; a compiler error ends the session
    there, printed once, instead of failing (or timing out) every test that loads the engine."""
    compiler = tmp_path / "refusing-c++"
    compiler.write_text('#!/bin/sh\ncase " $* " in *" -c "*) echo "error: the stand-in compiler refuses" >&2; '
                        'exit 1;; esac\nexec c++ "$@"\n')
    compiler.chmod(0o755)
    env = {**os.environ, "CXX": str(compiler), "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    pytest_args = ["-q", "-p", "no:cacheprovider", "tests/core/test_block_pool.py"]
    run = subprocess.run([sys.executable, "-m", "pytest", *pytest_args], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=HANG_GUARD_S)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    assert "nanopaged's CPU kernels did not build, so no test ran" in out
    assert "error: the stand-in compiler refuses" in out
    assert " passed" not in out
