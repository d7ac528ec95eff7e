"""Every result a run saves follows one protocol (`core.result.Result`): `save` into a folder,
`load` back, and the loaded result's `markdown` is the saved one's, character for character."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from qtransform.core.result import Result
from qtransform.models import build_tiny
from qtransform.rl.parity_report import ParityReport
from qtransform.scan.compare import Comparison
from qtransform.scan.report import ScanReport
from qtransform.scan.runs import RunComparison, compare_runs
from qtransform.scan.sensitivity import site_sensitivity
from qtransform.scan.sensitivity_report import SensitivityReport
from qtransform.scan.weights import compare_formats, scan_weights

RESULTS = (ScanReport, Comparison, SensitivityReport, RunComparison, ParityReport)


def _scan(tmp: Path) -> ScanReport:
    return scan_weights(build_tiny("qwen2"), "mxfp4", rotation="hadamard-32")


def _comparison(tmp: Path) -> Comparison:
    return compare_formats(build_tiny("qwen2"), ["mxfp4", "nvfp4"])


def _sensitivity(tmp: Path) -> SensitivityReport:
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    return site_sensitivity(build_tiny("qwen2"), "mxfp4", ids, method="both", draws=1)


def _runs(tmp: Path) -> RunComparison:
    for fmt in ("mxfp4", "nvfp4"):
        scan_weights(build_tiny("qwen2"), fmt).save(tmp / fmt)
    return compare_runs([tmp / "mxfp4", tmp / "nvfp4"])


def _parity(tmp: Path) -> ParityReport:
    trainer = [[-1.25, -0.5, -3.0], [-0.75, -2.0]]
    engine = [[-1.0, -0.5, -math.inf], [-0.5, -2.25]]  # one token outside the engine's support
    return ParityReport.build(
        phase="rollout", trainer=trainer, engine=engine, prompts=[[5, 17], [90, 4, 61]],
        completions=[[8, 9, 10], [11, 12]], metrics={"kl": 0.125, "k3_kl": math.nan},
        outside_support=1, floor={"kl": 0.0625, "k3_kl": 0.0}, attribution=None,
        greedy_agreement=0.5, first_divergence=[0, None], top=4, tokenizer=None,
        meta={"model": "tiny", "engine": "hf", "seed": 0})


BUILD = {ScanReport: _scan, Comparison: _comparison, SensitivityReport: _sensitivity,
         RunComparison: _runs, ParityReport: _parity}


@pytest.mark.parametrize("cls", RESULTS, ids=lambda c: c.__name__)
def test_a_result_saves_loads_and_renders_the_same_markdown(cls, tmp_path):
    result = BUILD[cls](tmp_path)
    assert isinstance(result, Result) and isinstance(result, cls)
    paths = result.save(tmp_path / "out")
    assert all(Path(p).is_file() and Path(p).parent == tmp_path / "out" for p in paths.values())
    for where in (tmp_path / "out", next(p for p in paths.values() if str(p).endswith(".json"))):
        back = cls.load(where)
        assert type(back) is cls
        assert back.markdown() == result.markdown()
    md = next(p for p in paths.values() if str(p).endswith(".md"))
    assert Path(md).read_text() == result.markdown()
