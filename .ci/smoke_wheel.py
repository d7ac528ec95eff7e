"""CI's smoke test of the installed wheel, run by .ci/run from outside the source tree with the
python of a fresh environment that has the wheel (not an editable install): every module imports,
the package data is there, `qtransform plan` and `qtransform transform` run, and the saved model
reloads and runs its fake-quant through the C fast path compiled from the installed qfast.c."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
import tempfile
from pathlib import Path

OPTIONAL = {"peft", "triton", "trl", "vllm"}  # extras; modules that need them may fail to import


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["QTRANSFORM_CACHE_DIR"] = str(Path(tmp) / "cache")  # compile from this copy
        import torch

        import qtransform
        from qtransform.formats import fastpath

        root = Path(qtransform.__file__).parent
        assert "site-packages" in root.parts, f"qtransform imported from {root}, not the installed wheel"
        names = [m.name for m in pkgutil.walk_packages(qtransform.__path__, "qtransform.")]
        for name in names:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as exc:
                if exc.name not in OPTIONAL:
                    raise
        for data in ("schemas/policy.schema.json", "data/calibration.txt", "formats/qfast.c"):
            assert (root / data).is_file(), f"the wheel lacks qtransform/{data}"
        policy = root / "schemas" / "examples" / "w4a16_mxfp4.json"
        cli = Path(sys.executable).with_name("qtransform")
        plan = subprocess.run([cli, "plan", "builtin:qwen2", policy], check=True, text=True,
                              capture_output=True).stdout
        assert "14 of 22 sites selected" in plan, plan
        out = Path(tmp) / "qwen2-w4a16"
        subprocess.run([cli, "transform", "builtin:qwen2", policy, "--out", out], check=True)
        model = qtransform.load_transformed(out)
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        logits = model(input_ids=ids).logits
        assert torch.isfinite(logits).all()
        assert fastpath.library() is not None, f"fast path: {fastpath.unavailable_reason()}"
        print(f"wheel smoke test: {len(names)} modules, plan, transform, reload, forward: ok")


if __name__ == "__main__":
    main()
