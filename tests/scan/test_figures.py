"""The PNGs read at a glance: the worst sites named, the limits the flags really use, a layer ×
role heatmap. Asserted on the matplotlib artists, not on pixels."""

from __future__ import annotations

import math

import numpy as np
import pytest
from matplotlib.collections import PathCollection
from matplotlib.image import AxesImage
from matplotlib.lines import Line2D

from qtransform.models import build_tiny
from qtransform.scan import scan_weights
from qtransform.scan.activations import scan_activations
from qtransform.scan.render import report_figure
from qtransform.scan.sensitivity import site_sensitivity
from qtransform.scan.sensitivity_report import LABELED, short_name
from tests.conftest import ids

W4A4 = {"version": 1, "quantize": [{"targets": ["Linear"], "format": "mxfp4", "tensors": ["weight", "input"]}]}


def _hlines(ax) -> dict[str, float]:
    """Horizontal lines by legend label: y of a line whose two ends share it."""
    out = {}
    for line in ax.get_lines():
        y = line.get_ydata()
        if isinstance(line, Line2D) and len(y) == 2 and y[0] == y[1] and list(line.get_xdata()) == [0, 1]:
            out[line.get_label()] = float(y[0])
    return out


@pytest.fixture(scope="module")
def activation_report():
    return scan_activations(build_tiny("qwen2"), W4A4, ids(2, 8), batch_size=2, token_stride=1)


def test_activation_plot_draws_the_limits_the_flags_use(activation_report):
    report = activation_report
    top, bottom = report_figure(report).axes
    for ax, metric, scale in ((top, "sqnr_db", 1.0), (bottom, "deadzone", 100.0)):
        lines = _hlines(ax)
        for point in ("weight", "input"):
            rows = [r for r in report.rows if r.point == point and r.layer is not None]
            limits = {report.flag_limit(r, metric) for r in rows}
            assert len(limits) == 1  # one block structure: one limit per point kind
            (label, y), = [(k, v) for k, v in lines.items() if k.startswith(f"{point} flag rule")]
            assert y == limits.pop() * scale
        assert not any(k.startswith("output flag rule") for k in lines)  # outputs: outliers only
        assert "output: no expected baseline, flagged only as a robust outlier" in [
            c.get_label() for c in ax.collections]
        assert all(abs(y - 20.0) > 1 for y in lines.values())  # not the absolute 20 dB line
    # the drawn SQNR limit is the one that flags: a row just below it is flagged, just above not
    row = next(r for r in report.rows if r.point == "input")
    limit = report.flag_limit(row, "sqnr_db")
    for value, flagged in ((limit - 1e-6, True), (limit + 1e-6, False)):
        row.metrics["sqnr_db"] = value
        assert any(w.startswith("SQNR") and "Gaussian data" in w for w in report.row_problems(row)) is flagged


def test_absolute_flagging_draws_its_threshold():
    report = scan_weights(build_tiny("qwen2"), "mxfp4", flagging="absolute", thresholds={"sqnr_db": 17.5})
    top, bottom, _heat = report_figure(report).axes[:3]
    assert _hlines(top) == {"flag rule (absolute): SQNR < 17.5 dB": 17.5}
    assert _hlines(bottom) == {"flag rule (absolute): deadzone > 5 %": 5.0}


def test_weight_scan_heatmap_is_layers_by_roles_of_sqnr():
    report = scan_weights(build_tiny("qwen2"), "mxfp4")
    fig = report_figure(report)
    heat = fig.axes[2]
    (image,) = [a for a in heat.get_children() if isinstance(a, AxesImage)]
    roles = [t.get_text() for t in heat.get_yticklabels()]
    assert roles == ["q", "k", "v", "o", "gate", "up", "down"]
    assert [t.get_text() for t in heat.get_xticklabels()] == ["0", "1"]
    want = [[next(r.metrics["sqnr_db"] for r in report.rows if r.layer == layer and r.role == role)
             for layer in (0, 1)] for role in roles]
    np.testing.assert_array_equal(np.asarray(image.get_array()), np.array(want))


def test_sensitivity_plot_names_the_worst_sites():
    sens = site_sensitivity(build_tiny("qwen2", num_layers=4), "mxfp4", ids(2, 8))
    ax = sens.figure().axes[0]
    texts = {t.get_text(): t.xy for t in ax.texts}
    worst = sens.ranked()[:LABELED]
    assert len(texts) == LABELED == len(worst) and len(sens.rows) > LABELED
    for r in worst:
        assert texts[f"{r.rank}. {short_name(r.site)}"] == (r.layer, r.exact)
    circled = [c for c in ax.collections if isinstance(c, PathCollection)
               and c.get_label().endswith("most sensitive, named")]
    assert len(circled) == 1 and len(circled[0].get_offsets()) == LABELED
    assert all(math.isfinite(r.exact) for r in worst)
