"""Streaming error metrics between a tensor and its quantized copy.

Scans see a model one tensor (or one activation batch) at a time and must add results up across
tensors, batches and formats without holding any of them, so every metric here is a function of
float64 running sums that can be updated chunk by chunk and merged. docs/metrics.md defines each
metric and says which to trust; NUMERICS.md (Metrics) is the contract.

Kurtosis comes from raw power sums (Σx .. Σx⁴). Turning them into central moments cancels
digits in proportion to (|mean| / std)⁴: irrelevant for weights and activations, whose mean is
small next to their spread, but do not read kurtosis of a tensor like 1000 ± 0.001 from here.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qtransform.formats import fastpath

_CHUNK = 1 << 15  # elements per chunk of the torch path (19 float64 rows: 5 MB)
_SUMS = (
    "sum_x", "sum_x2", "sum_x3", "sum_x4", "sum_q", "sum_q2", "sum_q3", "sum_q4",
    "sum_e2", "sum_abs_e", "sum_xq", "sum_rel", "nonzero", "deadzone", "saturated",
)
_COUNTS = ("n", "saturation_checked", "nan_orig", "nan_quant", "nonfinite")
# the accumulator: one float64 vector (counts are exact below 2^53), laid out as qfast.c's qf_stats
_FIELDS = (*_SUMS, *_COUNTS, "max_abs_error")
_F = {name: i for i, name in enumerate(_FIELDS)}
_MAX = _F["max_abs_error"]
assert len(_FIELDS) == fastpath.STATS_SLOTS


def _ratio(num: float, den: float) -> float:
    """num / den with the IEEE limits (x/0 = ±inf, 0/0 = NaN) instead of an exception."""
    if den == 0.0:
        return math.nan if num == 0.0 or math.isnan(num) else math.copysign(math.inf, num)
    return num / den


class ErrorStats:
    """Running float64 sums for the error between `x` and its quantized copy `xq`.

    `update` many times (any chunking, any shapes), `merge` accumulators of other tensors or
    workers, then `result()`. Pairs where x or xq is NaN/Inf are left out of every sum and counted
    (`nan_orig`, `nan_quant`, `nonfinite`), so one NaN block cannot hide the rest of a tensor and
    is still reported. All sums and counts live in one float64 vector on the device of the first
    update: an update never waits for the device, reading a count or `result()` does. On CPU an
    update is one call of the compiled kernel (`fastpath.error_stats`) that adds into that vector.
    """

    def __init__(self) -> None:
        self._acc: torch.Tensor | None = None  # float64, one entry per name in _FIELDS

    def _count(self, name: str) -> int:
        return 0 if self._acc is None else int(self._acc[_F[name]])

    @property
    def n(self) -> int:
        """Pairs measured (finite x and xq)."""
        return self._count("n")

    @property
    def saturation_checked(self) -> int:
        """Measured pairs that came with a saturation mask."""
        return self._count("saturation_checked")

    @property
    def nan_orig(self) -> int:
        """NaN values seen in x."""
        return self._count("nan_orig")

    @property
    def nan_quant(self) -> int:
        """NaN values seen in xq (an MX block holding an Inf comes out all NaN)."""
        return self._count("nan_quant")

    @property
    def nonfinite(self) -> int:
        """Pairs left out because x or xq was NaN or ±Inf."""
        return self._count("nonfinite")

    def update(self, x: torch.Tensor, xq: torch.Tensor, saturated: torch.Tensor | None = None) -> ErrorStats:
        """Add the pairs (x, xq); `saturated` is the format's clipped-at-max-normal mask, if known."""
        if x.shape != xq.shape or (saturated is not None and saturated.shape != x.shape):
            extra = "" if saturated is None else f", saturated {tuple(saturated.shape)}"
            raise ValueError(f"shape mismatch: x {tuple(x.shape)}, xq {tuple(xq.shape)}{extra}")
        if x.numel() == 0:
            return self
        if self._acc is None and x.is_cpu:
            self._acc = torch.zeros(len(_FIELDS), dtype=torch.float64)
        if self._acc is not None and fastpath.error_stats(x, xq, saturated, self._acc):
            return self
        self._add(_pass(x.detach().reshape(-1), xq.detach().reshape(-1),
                        None if saturated is None else saturated.detach().reshape(-1)))
        return self

    def _add(self, v: torch.Tensor) -> None:
        """Add an accumulator vector: sums and counts add, the max is kept."""
        if self._acc is None:
            self._acc = v.clone()
            return
        v = v.to(self._acc.device)
        self._acc[:_MAX] += v[:_MAX]
        torch.maximum(self._acc[_MAX:], v[_MAX:], out=self._acc[_MAX:])

    def merge(self, other: ErrorStats) -> ErrorStats:
        """Add another accumulator (another tensor, batch or worker) into this one."""
        if other._acc is not None:
            self._add(other._acc)
        return self

    def state(self) -> dict[str, float]:
        """The raw accumulator as plain numbers (JSON-able; `from_state` rebuilds it exactly)."""
        values = self._acc.tolist() if self._acc is not None else [0.0] * len(_FIELDS)
        raw = dict(zip(_FIELDS, values, strict=True))
        out: dict[str, float] = {k: int(raw[k]) for k in _COUNTS}
        out.update((k, raw[k]) for k in (*_SUMS, "max_abs_error"))
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ErrorStats:
        """Inverse of `state()`, e.g. to re-aggregate the rows of a saved report."""
        stats = cls()
        if any(state[k] for k in _COUNTS):
            stats._acc = torch.tensor([float(state[k]) for k in _FIELDS], dtype=torch.float64)
        return stats

    def result(self) -> dict[str, float]:
        """The metrics (defined in docs/metrics.md); NaN where a metric is undefined."""
        s = self.state()
        n = s["n"]
        mse = _ratio(s["sum_e2"], n)
        var_x = _ratio(s["sum_x2"], n) - _ratio(s["sum_x"], n) ** 2
        return {
            "n": n,
            "sqnr_db": _sqnr_db(s["sum_x2"], s["sum_e2"]),
            "mse": mse,
            "rmse": math.sqrt(mse),
            "rel_rmse": _ratio(math.sqrt(mse), math.sqrt(max(var_x, 0.0))),
            "cosine": _ratio(s["sum_xq"], math.sqrt(s["sum_x2"]) * math.sqrt(s["sum_q2"])),
            "max_abs_error": s["max_abs_error"] if n else math.nan,
            "deadzone": _ratio(s["deadzone"], s["nonzero"]),
            "saturation": _ratio(s["saturated"], s["saturation_checked"]),
            "mean_rel_error": _ratio(s["sum_rel"], s["nonzero"]),
            "kurtosis_orig": _kurtosis(n, s["sum_x"], s["sum_x2"], s["sum_x3"], s["sum_x4"]),
            "kurtosis_quant": _kurtosis(n, s["sum_q"], s["sum_q2"], s["sum_q3"], s["sum_q4"]),
            "nonzero": int(s["nonzero"]),
            "deadzone_count": int(s["deadzone"]),
            "saturated_count": int(s["saturated"]),
            "nan_orig": s["nan_orig"],
            "nan_quant": s["nan_quant"],
            "nonfinite": s["nonfinite"],
        }


def _pass(xf: torch.Tensor, qf: torch.Tensor, sf: torch.Tensor | None) -> torch.Tensor:
    """Torch path (other devices, float64, no compiler): the accumulator vector of one flat
    pair, from float64 element math on chunks and one stacked reduction per chunk.

    The same terms as qf_stats: non-finite pairs become (0, 0), which adds nothing to any sum,
    and are counted; |e|/|x| is taken where x != 0. Masks are float64 rows, not bool tensors
    (which cost several times more per element on CPU), and nothing is read back to the host.
    """
    chunk = min(_CHUNK, xf.numel())
    rows = torch.zeros(_F["nonfinite"], chunk, dtype=torch.float64, device=xf.device)
    acc = torch.zeros(len(_FIELDS), dtype=torch.float64, device=xf.device)
    views = _RowViews(rows)
    for start in range(0, xf.numel(), chunk):
        xs, qs = xf[start : start + chunk], qf[start : start + chunk]
        if xs.numel() < chunk:
            views = _RowViews(rows[:, : xs.numel()])
        R = views
        R.x.copy_(xs)
        R.q.copy_(qs)
        torch.ne(R.v, R.v, out=R.nan)  # NaN != NaN: the nan_orig and nan_quant rows
        torch.mul(R.v, 0.0, out=R.p2)  # 0 where finite, NaN where not
        torch.eq(R.p2[0] + R.p2[1], 0.0, out=R.ok)
        R.v.nan_to_num_(0.0, 0.0, 0.0).mul_(R.ok)  # a pair with a NaN/Inf becomes (0, 0)
        torch.mul(R.v, R.v, out=R.p2)
        torch.mul(R.p2, R.v, out=R.p3)
        torch.mul(R.p2, R.p2, out=R.p4)
        torch.sub(R.x, R.q, out=R.ae)
        torch.mul(R.ae, R.ae, out=R.e2)
        R.ae.abs_()
        torch.mul(R.x, R.q, out=R.xq)
        torch.div(R.ae, torch.abs(R.x, out=R.rel), out=R.rel).nan_to_num_(0.0, 0.0)  # x == 0: 0
        torch.ne(R.x, 0.0, out=R.nz)
        torch.eq(R.q, 0.0, out=R.dz).mul_(R.nz)
        if sf is not None:
            R.sat.copy_(sf[start : start + chunk]).ne_(0.0).mul_(R.ok)
        acc[: _F["nonfinite"]] += R.all.sum(dim=1)  # the saturation_checked row stays 0
        torch.maximum(acc[_MAX], R.ae.max(), out=acc[_MAX])
    if sf is not None:
        acc[_F["saturation_checked"]] = acc[_F["n"]]
    acc[_F["nonfinite"]] = xf.numel() - acc[_F["n"]]
    return acc


class _RowViews:
    """Named rows of the torch path's float64 chunk buffer, one per accumulator field."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.all = rows
        self.v, self.p2, self.p3, self.p4 = rows[:8].view(2, 4, -1).unbind(1)  # x.. x⁴, q.. q⁴
        self.x, self.q = self.v
        self.e2, self.ae, self.xq = rows[_F["sum_e2"]], rows[_F["sum_abs_e"]], rows[_F["sum_xq"]]
        self.rel, self.nz, self.dz = rows[_F["sum_rel"]], rows[_F["nonzero"]], rows[_F["deadzone"]]
        self.sat, self.ok = rows[_F["saturated"]], rows[_F["n"]]
        self.nan = rows[_F["nan_orig"] : _F["nan_quant"] + 1]  # [nan_orig, nan_quant]


def _kurtosis(n: float, s1: float, s2: float, s3: float, s4: float) -> float:
    """Pearson (non-excess) kurtosis m4 / m2² from raw power sums; a normal gives 3."""
    if n == 0:
        return math.nan
    mu = s1 / n
    m2 = s2 / n - mu * mu
    m4 = s4 / n - 4 * mu * s3 / n + 6 * mu * mu * s2 / n - 3 * mu**4
    return _ratio(m4, m2 * m2)


def _sqnr_db(signal: float, noise: float) -> float:
    """10·log10(signal / noise) with no epsilon: +inf without error, NaN when both are zero."""
    if noise == 0.0:
        return math.nan if signal == 0.0 else math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


class BlockExponentHistogram:
    """Counts of MX shared block exponents (E8M0: -127..127), mergeable like `ErrorStats`.

    Values outside that range (how a format marks a NaN block) are counted as `out_of_range`.
    """

    LOW, HIGH = -127, 127

    def __init__(self) -> None:
        self.counts = torch.zeros(self.HIGH - self.LOW + 1, dtype=torch.int64)
        self.out_of_range = 0

    def update(self, exponents: torch.Tensor) -> BlockExponentHistogram:
        # bin 0 collects everything below LOW, the last bin everything above HIGH
        e = exponents.detach().reshape(-1)
        bins = torch.zeros(self.counts.numel() + 2, dtype=torch.int64)
        if not fastpath.bincount(e, self.LOW, bins):
            e = e.to("cpu", torch.int64)
            bins += torch.bincount((e - (self.LOW - 1)).clamp_(0, bins.numel() - 1), minlength=bins.numel())
        self.counts += bins[1:-1]
        self.out_of_range += int(bins[0] + bins[-1])
        return self

    def merge(self, other: BlockExponentHistogram) -> BlockExponentHistogram:
        self.counts += other.counts
        self.out_of_range += other.out_of_range
        return self

    def result(self) -> dict[str, Any]:
        """Sparse histogram {exponent: blocks} plus range and block count."""
        nz = torch.nonzero(self.counts).reshape(-1).tolist()
        hist = {str(i + self.LOW): int(self.counts[i]) for i in nz}
        return {
            "blocks": int(self.counts.sum()) + self.out_of_range,
            "min": nz[0] + self.LOW if nz else None,
            "max": nz[-1] + self.LOW if nz else None,
            "out_of_range": self.out_of_range,
            "counts": hist,
        }

    @classmethod
    def from_result(cls, result: dict[str, Any]) -> BlockExponentHistogram:
        hist = cls()
        for exp, count in result["counts"].items():
            hist.counts[int(exp) - cls.LOW] = int(count)
        hist.out_of_range = int(result["out_of_range"])
        return hist
