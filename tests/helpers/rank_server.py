"""The process that test ranks are forked from (tests/helpers/forklaunch.py starts one per pytest worker).

    python -m tests.helpers.rank_server

It imports the modules every rank needs once (``PRELOAD``), then reads requests from stdin, one JSON
object per line: ``{"script", "argv", "env", "cwd", "log"}``. For each it forks; the parent answers
``{"pid": PID}`` on stdout, and ``{"pid": PID, "exit": CODE}`` when that child ends (CODE as
``os.waitstatus_to_exitcode``: negative for a signal). The child leaves the request loop and becomes
``python script argv...``: a new ``__main__`` module in ``sys.modules``, the script's folder first on
sys.path, its own session, output appended to ``log``. When the script ends, non-daemon threads are
joined and the atexit handlers run, as at any interpreter exit; then the process leaves with
``os._exit`` (the module teardown costs ~0.6 s of CPU per rank with torch loaded), unless the request
says ``"teardown": true``: then the interpreter's own exit follows (module teardown, C++ static
destructors), as after ``python script.py``. That choice is why ranks are not forked by
multiprocessing's forkserver, whose children always leave with ``os._exit``: a crash in the
interpreter's teardown (tests/test_clean_exit.py) would not show there.

What differs from a fresh interpreter: the preloaded modules are already imported (their import-time
reads of the environment are the server's: it starts with one OpenMP/BLAS thread, as the tests' runs
do). trainforge itself is not preloaded, so an edited source file is what each rank runs.
"""

from __future__ import annotations

import atexit
import gc
import io
import json
import os
import select
import sys
import threading
import traceback
import types
import warnings
from importlib.machinery import SourceFileLoader
from typing import Any, Callable, Dict, Optional

PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.nn.parallel",
    "torch._dynamo",
    "torchdata.stateful_dataloader",
    "safetensors.torch",
    "tqdm",
    "yaml",
    "psutil",
    # ~2 s per rank that builds a Llama (Megatron, empty init, adapters, resume tests: ~30 ranks); ranks that
    # do not use it pay nothing for it, as they leave without the module teardown
    "transformers",
    "transformers.models.llama.modeling_llama",
]


def _reply(message: Dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def serve() -> Dict[str, Any]:
    """The request loop. Returns only in a forked child, with its request; the server itself exits
    when stdin closes (the pytest worker is gone)."""
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:  # an optional package: the ranks that need it import it (and fail) themselves
            pass
    # Out of the collector's reach: a rank's first full collection would otherwise write to every preloaded
    # object's header and so copy the server's whole heap into the rank (~0.2 CPU-s and ~120 MB per process
    # forked from here or from a rank, DataLoader workers included).
    gc.collect()
    gc.freeze()
    # A fork copies only the forking thread: a preloaded module that started one (deepspeed does: it is
    # not preloaded) could leave a lock held in every rank. The client refuses a server with more.
    _reply({"ready": True, "threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1})
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            data = os.read(0, 1 << 16)
            if not data:
                sys.exit(0)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    return request
                _reply({"pid": pid})
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _reply({"pid": pid, "exit": os.waitstatus_to_exitcode(status)})


def become(request: Dict[str, Any]) -> None:
    """In the forked child: from here on this process is ``python script argv...``."""
    os.setsid()  # its own process group: the test stops the rank with what it started (DataLoader workers)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    script = request["script"]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[0:1] = [os.path.dirname(os.path.abspath(script)), *extra]
    sys.argv = [script, *request["argv"]]
    if env.get("PYTHONWARNINGS"):  # read by the interpreter at start-up, which this process skipped
        warnings._processoptions(env["PYTHONWARNINGS"].split(","))  # type: ignore[attr-defined]
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=script, __builtins__=__builtins__, __loader__=SourceFileLoader("__main__", script), __spec__=None
    )
    sys.modules["__main__"] = main  # stays there until the interpreter's teardown, as a script's module does
    with open(script, "rb") as source:
        code = compile(source.read(), script, "exec")
    if request.get("teardown"):
        exec(code, main.__dict__)  # an uncaught exception: the interpreter prints it and exits 1
        return  # then the interpreter's own exit
    exit_after(lambda: exec(code, main.__dict__))


def exit_after(run: Callable[[], Any]) -> None:
    """``run()``, then the end of a forked child as Python ends a script: the ``sys.exit`` code (a message:
    printed, 1), an uncaught exception's traceback and 1; never returns. Also the docs runner's children."""
    status: Any = 0
    try:
        run()
    except SystemExit as stop:
        status = stop.code
    except BaseException:
        traceback.print_exc()
        status = 1
    # Python's exit order up to the module teardown: non-daemon threads joined, then the atexit handlers.
    # The teardown itself (~0.6 s of CPU per rank with torch loaded) is skipped, as multiprocessing's
    # children skip it; the tests of the interpreter's exit ask for it ("teardown").
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        status = status or 1
    sys.stdout.flush()
    sys.stderr.flush()
    if status is None:
        status = 0
    elif not isinstance(status, int):  # sys.exit("message"): printed, exit status 1
        print(status, file=sys.stderr, flush=True)
        status = 1
    os._exit(status & 0xFF)


if __name__ == "__main__":
    request: Optional[Dict[str, Any]] = serve()
    if request is not None:
        become(request)
