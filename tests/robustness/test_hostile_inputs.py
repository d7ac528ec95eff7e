"""Hostile inputs to every command: each one is exit 2, one line naming the problem and the fix,
no traceback, and nothing on disk changed (the case folder and the shared models are compared
before and after).

The table says what each case builds in its folder and which words the error line must hold.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.robustness.conftest import W4A16, snapshot

Setup = Callable[[Path, dict[str, Path]], list]


def copy_model(tmp: Path, models: dict[str, Path], arch: str = "qwen2") -> Path:
    dest = tmp / f"{arch}-copy"
    shutil.copytree(models[arch], dest)
    return dest


def damaged_weights(change: Callable[[bytes], bytes]) -> Setup:
    def setup(tmp: Path, models: dict[str, Path]) -> list:
        model = copy_model(tmp, models)
        weights = model / "model.safetensors"
        weights.write_bytes(change(weights.read_bytes()))
        return ["plan", model, W4A16]
    return setup


def _lying_offsets(data: bytes) -> bytes:
    """A header whose first tensor claims bytes far past the end of the file."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    key = next(k for k in header if k != "__metadata__")
    lo, hi = header[key]["data_offsets"]
    header[key]["data_offsets"] = [lo, hi + 10**9]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n:]


def config_edit(edit: Callable[[dict], dict | str]) -> Setup:
    def setup(tmp: Path, models: dict[str, Path]) -> list:
        model = copy_model(tmp, models)
        config = json.loads((model / "config.json").read_text())
        new = edit(config)
        (model / "config.json").write_text(new if isinstance(new, str) else json.dumps(new))
        return ["plan", model, W4A16]
    return setup


def policy_case(policy: dict | str, arch: str = "qwen2") -> Setup:
    def setup(tmp: Path, models: dict[str, Path]) -> list:
        path = tmp / "policy.json"
        path.write_text(policy if isinstance(policy, str) else json.dumps(policy))
        return ["plan", models[arch], path]
    return setup


def quantize(**rule) -> dict:
    return {"version": 1, "quantize": [{"targets": ["Linear"], "format": "mxfp4", **rule}]}


def calib_case(content: bytes | None, name: str = "calib.txt") -> Setup:
    def setup(tmp: Path, models: dict[str, Path]) -> list:
        path = Path("/dev/zero") if content is None else tmp / name
        if content is not None:
            path.write_bytes(content)
        return ["scan", models["qwen2"], "--format", "mxfp4", "--calib", path, "--out", tmp / "out"]
    return setup


def _pickles_only(tmp: Path, models: dict[str, Path]) -> list:
    model = copy_model(tmp, models)
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    return ["plan", model, W4A16]


def _dangling(tmp: Path, models: dict[str, Path]) -> list:
    (tmp / "model").symlink_to(tmp / "gone")
    return ["plan", tmp / "model", W4A16]


def _fifo_weights(tmp: Path, models: dict[str, Path]) -> list:
    os.mkfifo(tmp / "model.safetensors")
    return ["scan", tmp / "model.safetensors", "--format", "mxfp4", "--out", tmp / "out"]


def _two_unrelated_checkpoints(tmp: Path, models: dict[str, Path]) -> list:
    folder = tmp / "ckpts"
    folder.mkdir()
    shutil.copy(models["qwen2"] / "model.safetensors", folder / "a.safetensors")
    shutil.copy(models["gpt2"] / "model.safetensors", folder / "b.safetensors")
    return ["scan", folder, "--format", "mxfp4", "--out", tmp / "out"]


def _report(tmp: Path, data: dict) -> Path:
    path = tmp / "report.json"
    path.write_text(json.dumps(data))
    return path


def guide_case(data: dict, *extra: str) -> Setup:
    def setup(tmp: Path, models: dict[str, Path]) -> list:
        return ["guide", _report(tmp, data), "--out", tmp / "policy.json", *extra]
    return setup


CRAFTED = {"schema": "qtransform.scan_report", "schema_version": "1", "meta": {},
           "thresholds": {}, "rows": [{"site": "x", "point": "weight"}]}
STALE = {"schema": "qtransform.scan_report", "schema_version": "0", "meta": {}, "rows": []}
GOOD_REPORT = {"schema": "qtransform.scan_report", "schema_version": "1", "meta": {},
               "thresholds": {}, "rows": []}


def export_case(*extra: str, out: str = "m.onnx") -> Setup:
    def setup(tmp: Path, models: dict[str, Path]) -> list:
        return ["export", "builtin:qwen2", "--policy", W4A16, "--out", tmp / out, *extra]
    return setup


def _out_exists_as(kind: str, command: str = "transform") -> Setup:
    def setup(tmp: Path, models: dict[str, Path]) -> list:
        target = tmp / "target"
        if kind == "folder":
            (target / "sub").mkdir(parents=True)
            (target / "notes.txt").write_text("mine")
            (target / "sub" / "data.bin").write_bytes(b"\x00" * 10)
        elif kind == "file":
            target.write_text("a file")
        elif kind == "fifo":
            os.mkfifo(target)
        elif kind == "device":
            try:
                os.mknod(target, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # like /dev/null
            except PermissionError:
                os.mkfifo(target)
        if command == "transform":
            return ["transform", models["qwen2"], W4A16, "--out", target]
        if command == "export":
            return ["export", "builtin:qwen2", "--policy", W4A16, "--out", target]
        return ["guide", _report(tmp, GOOD_REPORT), "--out", target]
    return setup


def _out_is_model_folder(tmp: Path, models: dict[str, Path]) -> list:
    model = copy_model(tmp, models)
    return ["transform", model, W4A16, "--out", model, "--force"]


def _out_is_cwd(tmp: Path, models: dict[str, Path]) -> list:
    (tmp / "keep.txt").write_text("precious")
    return ["transform", models["qwen2"], W4A16, "--out", ".", "--force"]


CASES: dict[str, tuple[Setup, tuple[str, ...]]] = {
    # models
    "truncated safetensors": (damaged_weights(lambda b: b[: len(b) // 2]), ("truncated or corrupt",)),
    "huge header length": (damaged_weights(lambda b: (10**12).to_bytes(8, "little") + b[8:]),
                           ("header of",)),
    "header not json": (damaged_weights(lambda b: b[:8] + b"\xff" * 16 + b[24:]), ("not JSON",)),
    "lying data offsets": (damaged_weights(_lying_offsets), ("past the end",)),
    "dangling symlink model": (_dangling, ("dangling symlink",)),
    "unsupported model_type": (config_edit(lambda c: {**c, "model_type": "qwen99"}),
                               ("unsupported model_type",)),
    "invalid config.json": (config_edit(lambda c: '{"model_type": "qwen2",'), ("invalid JSON",)),
    "config without model_type": (config_edit(lambda c: {"hidden_size": 8}), ("model_type",)),
    "remote code": (config_edit(lambda c: {**c, "auto_map": {"AutoModel": "x.Y"}}),
                    ("remote code",)),
    "unknown architecture": (config_edit(lambda c: {**c, "architectures": ["Qwen9ForMagic"]}),
                             ("Qwen9ForMagic",)),
    "pickled weights": (_pickles_only, ("pickles", "safetensors")),
    "fifo as weights file": (_fifo_weights, ("FIFO",)),
    "hub id to scan": (lambda tmp, m: ["scan", "Qwen/Qwen2.5-0.5B", "--format", "mxfp4",
                                       "--out", tmp / "out"], ("hub ids are not downloaded",)),
    "two checkpoints, no index": (_two_unrelated_checkpoints, ("not one sharded checkpoint",)),
    # calibration
    "/dev/zero as calibration": (calib_case(None), ("device",)),
    "calibration not UTF-8": (calib_case(b"caf\xe9 au lait\n"), ("not UTF-8",)),
    "calibration ids out of range": (calib_case(b"[[1, 2, 99999]]", "ids.json"),
                                     ("99999", "vocabulary")),
    "calibration ids beyond int64": (calib_case(b"[[1, 2, 99999999999999999999999]]", "ids.json"),
                                     ("64 bits",)),
    # policies
    "5000-digit integer": (policy_case('{"version": 1' + ', "quantize": [{"targets": ["Linear"], '
                                       '"format": "mxfp4", "seed": ' + "9" * 5000 + "}]}"),
                           ("digits",)),
    "NaN in a policy": (policy_case('{"version": 1, "instrument": {"thresholds": {"sqnr_db": NaN}}}'),
                        ("NaN",)),
    "1e999 in a policy": (policy_case('{"version": 1, "instrument": {"thresholds": {"sqnr_db": 1e999}}}'),
                          ("range",)),
    "class selector typo": (policy_case(quantize(targets=["Linaer"])), ("did you mean Linear",)),
    "norm selector on gpt2": (policy_case({"version": 1, "noise": {
        "targets": ["RMSNorm"], "schedule": {"sigma_start": 0.01, "sigma_end": 0.0001,
                                             "num_stages": 4, "total_steps": 100}}}, "gpt2"),
        ("RMSNorm", "LayerNorm")),
    "catastrophic regex": (policy_case(quantize(targets=["re:(a+)+$"])), ("nested quantifiers",)),
    "alternation in a repeat": (policy_case(quantize(targets=["re:(.|.)*x"])), ("alternation",)),
    "axis out of range": (policy_case(quantize(axis=5)), ("axis 5",)),
    # numeric options
    "opset 1000": (export_case("--opset", "1000"), ("opset 1000",)),
    "batch absurd": (export_case("--batch", "100000000"), ("--batch",)),
    "tiers 1e308": (guide_case(GOOD_REPORT, "--tiers", "1e308"), ("--tiers",)),
    "tiers nan": (guide_case(GOOD_REPORT, "--tiers", "nan,1"), ("--tiers",)),
    "threshold nan": (lambda tmp, m: ["scan", m["qwen2"], "--format", "mxfp4", "--threshold",
                                      "sqnr_db=nan", "--out", tmp / "out"], ("finite",)),
    "threshold inf": (lambda tmp, m: ["scan", m["qwen2"], "--format", "mxfp4", "--threshold",
                                      "deadzone=inf", "--out", tmp / "out"], ("finite",)),
    "total steps zero": (guide_case(GOOD_REPORT, "--total-steps", "0"), ("--total-steps",)),
    # reports given to guide
    "crafted report": (guide_case(CRAFTED), ("not a scan report",)),
    "stale report": (guide_case(STALE), ("version",)),
    "report is a fifo": (lambda tmp, m: (os.mkfifo(tmp / "r.json"), ["guide", tmp / "r.json", "--out",
                                                                      tmp / "p.json"])[1], ("FIFO",)),
    # output targets
    "transform into a foreign folder": (_out_exists_as("folder"), ("--force",)),
    "transform into a file": (_out_exists_as("file"), ("is a file",)),
    "transform into the model folder": (_out_is_model_folder, ("overlaps the input",)),
    "transform into the working directory": (_out_is_cwd, ("working directory",)),
    "export into a folder": (_out_exists_as("folder", "export"), ("is a folder",)),
    "export onto a device": (_out_exists_as("device", "export"), ("only a regular file",)),
    "guide onto a fifo": (_out_exists_as("fifo", "guide"), ("FIFO",)),
    "guide into a folder": (_out_exists_as("folder", "guide"), ("is a folder",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_input_is_one_line_and_touches_nothing(case, cli, models, tmp_path):
    setup, needles = CASES[case]
    argv = setup(tmp_path, models)
    before, shared = snapshot(tmp_path), snapshot(next(iter(models.values())).parent)
    result = cli(*argv, cwd=tmp_path, timeout=60)
    result.assert_user_error(*needles)
    assert snapshot(tmp_path) == before
    assert snapshot(next(iter(models.values())).parent) == shared
