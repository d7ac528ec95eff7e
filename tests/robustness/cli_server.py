"""Runs `qtransform` commands as forked child processes of one interpreter that imported it once.

Each command is a real process (its own exit status, stdout, stderr, signal handlers and working
directory, exactly as `qtransform` runs it: `main()` with `sys.argv`), but the two to eight
seconds that importing torch and transformers cost on a small CI machine are paid once per test
session instead of once per hostile input. Protocol: one JSON request per line on stdin
({"argv", "cwd", "stdout", "stderr", "timeout", "umask"}), one JSON reply per line ({"rc"}); a
child that outlives its timeout is killed and reported as rc -9 (a hang is a failure, never a
stuck test run).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import onnx  # noqa: E402,F401 - preloaded: the children share these pages
import onnxruntime  # noqa: E402,F401
import torch  # noqa: E402
import transformers  # noqa: E402,F401

from qtransform.cli.main import build_parser, main  # noqa: E402

torch.set_num_threads(1)
build_parser()  # imports every command module


def child(req: dict) -> int:
    """The body of a forked child: what the `qtransform` console script does."""
    os.chdir(req["cwd"])
    os.umask(req.get("umask", 0o022))
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["qtransform", *req["argv"]]
    try:
        code = main()
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # what the interpreter would print for an uncaught exception
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def serve() -> None:
    replies = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os._exit(child(req))
        deadline = time.monotonic() + req.get("timeout", 120)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                rc = -9
                break
            time.sleep(0.01)
        replies.write(json.dumps({"rc": rc}) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
