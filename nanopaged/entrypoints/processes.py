"""The server's processes, as vLLM V1 lays them out: who starts them, watches them, stops them.

    supervisor (this process)   opens the listening socket, starts the others, watches them
    engine cores (D)            engine_core.py: scheduler, runner, block pool; no text work;
                                D = --data-parallel-size, each with its own model copy and threads
    API servers (N)             api_server.py: HTTP, tokenizing, detokenizing; N = --api-server-count;
                                each connected to every engine core, routing new requests between them

Faults end cleanly, never in a hang: if the engine core dies, every API server sees its life
line close (a pipe only the core writes to), ends the requests in flight with an error and
answers /health with 503; the supervisor gives them a moment to say so, stops them and exits
1. With several engine cores only the dead core's requests end with the error, the others serve on
and /health says "degraded" while the supervisor starts another core in its place (at most
MAX_RESTARTS times a core; the new core's life line goes to each API server over its control pipe);
it exits 1 when none is left. If an API server dies, the engine cores abort that server's requests
(ClientGone) and the others serve on; with none left, the supervisor exits 1. SIGINT or SIGTERM stops every process
and exits 0. A supervisor killed outright (SIGKILL) can stop nothing: each child asked Linux, first
thing, for SIGTERM when its parent dies (prctl's PR_SET_PDEATHSIG), so the port is free within
seconds. Processes are spawned, not forked: torch's thread pools are not fork-safe. vLLM: vllm/v1/utils.py
(APIServerProcessManager), vllm/v1/engine/utils.py. docs/08_server.md, "Processes".
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from multiprocessing import reduction
from multiprocessing.connection import wait

import zmq

from nanopaged.entrypoints import core_messages as m
from nanopaged.entrypoints.api_server import run_api_server
from nanopaged.entrypoints.engine_core import run_engine_core

GRACE_S = 2.0            # after the engine core died: time for the API servers to answer with the error
MAX_RESTARTS = 3         # data parallelism: a dead engine core is started again at most this often
STOP_S = 10.0            # a process that has not stopped by then is killed
PR_SET_PDEATHSIG = 1     # <linux/prctl.h>: the signal a process gets when its parent dies


def serve_processes(args, settings: dict, describe, key: str | None, updating: bool) -> int:
    """Run the server until a signal (exit status 0) or a fault (1). `describe(config, num_kv_blocks)`:
    the ready line's (served name, details). A ValueError if it cannot start, saying why."""
    ctx = multiprocessing.get_context("spawn")
    folder = tempfile.mkdtemp(prefix="nanopaged-")
    n = args.data_parallel_size
    threads = args.engine_core_threads
    if threads is None and n > 1:          # the host's cores split between them, as evenly as they go
        threads = max(1, (os.cpu_count() or 1) // n)
    cores, lifelines, addresses = [], [], []
    for i in range(n):
        address = f"ipc://{folder}/engine-core" + (f"-{i}" if n > 1 else "")
        core, lifeline, info = start_engine_core(ctx, args.model, settings, address, threads, i)
        if core is None:
            for started in cores:
                started.terminate()
                _join(started)
            shutil.rmtree(folder, ignore_errors=True)
            raise ValueError(info)
        cores.append(core)
        lifelines.append(lifeline)
        addresses.append(address)
    supervisor = Supervisor(ctx, cores, lifelines, addresses, folder)
    supervisor.restart = lambda i: start_engine_core(ctx, args.model, settings, addresses[i], threads, i)
    try:
        return supervisor.run(args, info, describe, key, updating)
    finally:
        supervisor.stop_all()


def start_engine_core(ctx, model, settings: dict, address: str, threads: int | None = None, index: int = 0):
    """An engine-core process, once its model is loaded: (process, the life line's read end, its info),
    or (None, None, why not). `threads`: torch's CPU threads in it (None: torch's own count)."""
    ready_r, ready_w = ctx.Pipe(duplex=False)
    life_r, life_w = ctx.Pipe(duplex=False)
    core = ctx.Process(target=child_main, name=f"nanopaged-engine-core-{index}",
                       args=(os.getpid(), run_engine_core, model, settings, address, ready_w, life_w, threads))
    core.start()
    ready_w.close()
    life_w.close()                     # from here on only the core holds the life line's write end
    if not wait([ready_r, core.sentinel]) or not ready_r.poll():
        core.join()
        return None, None, f"the engine core exited with status {core.exitcode} while loading"
    answer = ready_r.recv()
    if answer[0] == "error":
        core.join()
        return None, None, answer[1]
    return core, life_r, answer[1:]


class Supervisor:
    def __init__(self, ctx, cores: list, lifelines: list, addresses: list[str], folder: str) -> None:
        self.ctx, self.cores, self.lifelines, self.addresses, self.folder = ctx, cores, lifelines, addresses, folder
        self.api_servers: dict[str, multiprocessing.Process] = {}
        self.sockets = []                  # to tell each core of deaths, and to stop it
        for address in addresses:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, b"supervisor")
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address)
            self.sockets.append(sock)
        self.live_cores = set(range(len(cores)))
        self.restarts = [0] * len(cores)
        self.restart = None                # restart(i): start engine core i again (serve_processes sets it)
        self.controls: dict[str, object] = {}   # API server -> the supervisor's end of its control pipe
        self.wake_r, self.wake_w = os.pipe()
        self.signal = None

    def run(self, args, info: tuple, describe, key: str | None, updating: bool) -> int:
        listener = socket.create_server((args.host, args.port), reuse_port=False)
        started_r, started_w = self.ctx.Pipe(duplex=False)
        for i in range(args.api_server_count):
            name = f"api-{i}"
            control = None
            if len(self.cores) > 1:        # to hand over a replaced core's life line
                self.controls[name], control = self.ctx.Pipe(duplex=True)
            self.api_servers[name] = self.ctx.Process(
                target=child_main, name=f"nanopaged-{name}",
                args=(os.getpid(), run_api_server, name, args, listener, self.addresses, self.lifelines, info,
                      started_w, key, updating, control))
            self.api_servers[name].start()
        started_w.close()
        error = self.wait_started(started_r)
        if error is not None:
            raise ValueError(error)
        host, port = listener.getsockname()[:2]
        listener.close()                  # the API servers hold it now
        name, details = describe(*info[:2])
        pids = ", ".join(str(c.pid) for c in self.cores)
        print(f"nanopaged: serving {name!r} at http://{host}:{port}/v1 ({details}; {args.api_server_count} API "
              f"server(s), engine core pid {pids})", flush=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.on_signal)
        return self.watch()

    def wait_started(self, started) -> str | None:
        """None once every API server listens; else why one did not start."""
        waiting = set(self.api_servers)
        while waiting:
            ready = wait([started, *(c.sentinel for c in self.cores), *(p.sentinel for p in self.api_servers.values())])
            if started in ready:
                try:
                    what, text = started.recv()
                except EOFError:
                    return "an API server exited before it started"
                if what == "error":
                    return text
                waiting.discard(text)
            elif any(c.sentinel in ready for c in self.cores):
                return f"an engine core exited with status {next(c.exitcode for c in self.cores if not c.is_alive())}"
            else:
                dead = [n for n, p in self.api_servers.items() if not p.is_alive()]
                return f"API server {dead[0]} exited with status {self.api_servers[dead[0]].exitcode} while starting"
        return None

    def on_signal(self, sig, frame) -> None:
        self.signal = sig
        os.write(self.wake_w, b"s")

    def watch(self) -> int:
        """Until a signal (0) or a fault (1)."""
        while True:
            sentinels = {p.sentinel: n for n, p in self.api_servers.items()}
            cores = {self.cores[i].sentinel: i for i in self.live_cores}
            ready = wait([self.wake_r, *cores, *sentinels])
            if self.signal is not None:
                return 0
            for i in [cores[s] for s in ready if s in cores]:
                self.live_cores.discard(i)
                self.cores[i].join(STOP_S)
                left = len(self.live_cores)
                print(f"nanopaged: engine core {i} died (exit status {self.cores[i].exitcode}); its requests in "
                      f"flight ended with an error; " + (f"{left} serve on" if left else "stopping"),
                      file=sys.stderr, flush=True)
                if left and self.signal is None:
                    self.replace(i)
            if not self.live_cores:
                wait([p.sentinel for p in self.api_servers.values()], timeout=GRACE_S)
                return 1
            for sentinel in ready:
                name = sentinels.get(sentinel)
                if name is not None:
                    process = self.api_servers.pop(name)
                    for i in self.live_cores:
                        self.sockets[i].send(m.encode(m.ClientGone(name)))
                    process.join(STOP_S)                 # its sentinel fires a moment before its status is there
                    print(f"nanopaged: API server {name} died (exit status {process.exitcode}); the engine "
                          f"core aborts its requests; {len(self.api_servers)} serve on", file=sys.stderr, flush=True)
            if not self.api_servers:
                return 1

    def replace(self, i: int) -> None:
        """Start engine core i again, at most MAX_RESTARTS times, and hand each API server its life line."""
        if self.restarts[i] >= MAX_RESTARTS:
            print(f"nanopaged: engine core {i} has been started {MAX_RESTARTS} times already: not again",
                  file=sys.stderr, flush=True)
            return
        self.restarts[i] += 1
        core, lifeline, info = self.restart(i)
        if core is None:
            print(f"nanopaged: engine core {i} could not be started again: {info}", file=sys.stderr, flush=True)
            return
        self.lifelines[i].close()
        self.cores[i], self.lifelines[i] = core, lifeline
        self.live_cores.add(i)
        for name, control in self.controls.items():
            if name in self.api_servers:
                control.send(("core", i))
                reduction.send_handle(control, lifeline.fileno(), self.api_servers[name].pid)
        print(f"nanopaged: engine core {i} started again (pid {core.pid}; restart {self.restarts[i]} of "
              f"{MAX_RESTARTS})", file=sys.stderr, flush=True)

    def stop_all(self) -> None:
        """API servers first (they finish what they can), then the engine core; nothing left behind."""
        for p in self.api_servers.values():
            if p.is_alive():
                p.terminate()                            # SIGTERM: uvicorn's graceful shutdown
        for p in self.api_servers.values():
            _join(p)
        for core, sock in zip(self.cores, self.sockets):
            if core.is_alive():
                sock.send(m.encode(m.Shutdown()))
        for core, sock in zip(self.cores, self.sockets):
            _join(core)
            sock.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def child_main(supervisor: int, body, *args) -> None:
    """A child's entry: it stops when the supervisor (pid `supervisor`) dies, then runs `body(*args)`.
    SIGTERM raises SystemExit, so multiprocessing's exit still stops the child's own daemon processes
    (tensor-parallel ranks); the API server hands SIGTERM to uvicorn once it serves."""
    signal.signal(signal.SIGTERM, _exit)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != supervisor:         # it died before we asked: no signal will come
        raise SystemExit(1)
    body(*args)


def _exit(sig, frame) -> None:
    raise SystemExit(0)


def _join(process) -> None:
    process.join(STOP_S)
    if process.is_alive():
        process.kill()
        process.join()
