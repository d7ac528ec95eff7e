"""Shared pieces of the robustness suite: a CLI runner, tiny saved models, disk snapshots.

Models are real transformers classes built from small configs with seeded weights and saved with
`save_pretrained` once per session; tests copy a folder before damaging it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
EXAMPLES = REPO / "schemas" / "examples"
W4A16 = EXAMPLES / "w4a16_mxfp4.json"


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str

    def assert_user_error(self, *needles: str) -> None:
        """Exit 2, exactly one line on stderr starting with 'error:', no traceback, and the
        line names the problem (each needle, case-insensitive)."""
        lines = self.stderr.strip().splitlines()
        assert self.rc == 2, f"rc {self.rc}\n{self.stderr[-3000:]}"
        assert "Traceback" not in self.stderr, self.stderr[-3000:]
        assert len(lines) == 1 and lines[0].startswith("error: "), self.stderr[-3000:]
        for needle in needles:
            assert needle.lower() in lines[0].lower(), lines[0]


class CLI:
    """`qtransform ARGS` in a real child process (see cli_server.py)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.count = 0
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "cli_server.py")], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)

    def __call__(self, *argv: str | os.PathLike, cwd: Path | None = None, timeout: float = 120,
                 umask: int = 0o022) -> Result:
        self.count += 1
        out, err = self.workdir / f"{self.count}.out", self.workdir / f"{self.count}.err"
        req = {"argv": [str(a) for a in argv], "cwd": str(cwd or self.workdir), "stdout": str(out),
               "stderr": str(err), "timeout": timeout, "umask": umask}
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply, "the CLI server died"
        return Result(json.loads(reply)["rc"], out.read_text(), err.read_text())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def cli(tmp_path_factory) -> CLI:
    runner = CLI(tmp_path_factory.mktemp("cli"))
    yield runner
    runner.close()


def save_tiny(folder: Path, arch: str) -> Path:
    """A real transformers model of `arch` saved with save_pretrained (seeded weights)."""
    import transformers as tf

    from qtransform.models import tiny_config

    torch.manual_seed(0)
    if arch == "t5":
        config = tf.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                             num_heads=4, decoder_start_token_id=0)
        model = tf.T5ForConditionalGeneration(config)
    elif arch == "gpt2":
        model = tf.GPT2LMHeadModel(tiny_config("gpt2"))
    else:
        model = tf.AutoModelForCausalLM.from_config(tiny_config(arch))
    model.eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    """Saved tiny models by name: qwen2 (Qwen2ForCausalLM), gpt2 (GPT2LMHeadModel), t5
    (T5ForConditionalGeneration). Read-only by convention: copy before changing."""
    root = tmp_path_factory.mktemp("models")
    return {arch: save_tiny(root / arch, arch) for arch in ("qwen2", "gpt2", "t5")}


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under root with its type, size, mtime and mode: what 'untouched' means."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out
