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

_CHUNK = 1 << 17  # elements per float64 pass: four rows of this stay in cache
_SUMS = (
    "sum_x", "sum_x2", "sum_x3", "sum_x4", "sum_q", "sum_q2", "sum_q3", "sum_q4",
    "sum_e2", "sum_abs_e", "sum_xq", "sum_rel", "nonzero", "deadzone", "saturated",
)
_S = {name: i for i, name in enumerate(_SUMS)}


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
    is still reported. Sums stay on the device of the first update until `result()`/`state()`.
    """

    def __init__(self) -> None:
        self.n = 0
        self.saturation_checked = 0  # elements that came with a saturation mask
        self.nan_orig = 0
        self.nan_quant = 0
        self.nonfinite = 0
        self._sums: torch.Tensor | None = None  # float64, one entry per name in _SUMS
        self._max: torch.Tensor | None = None  # float64 scalar: max |x - xq|

    def update(self, x: torch.Tensor, xq: torch.Tensor, saturated: torch.Tensor | None = None) -> ErrorStats:
        """Add the pairs (x, xq); `saturated` is the format's clipped-at-max-normal mask, if known."""
        if x.shape != xq.shape or (saturated is not None and saturated.shape != x.shape):
            extra = "" if saturated is None else f", saturated {tuple(saturated.shape)}"
            raise ValueError(f"shape mismatch: x {tuple(x.shape)}, xq {tuple(xq.shape)}{extra}")
        if x.numel() == 0:
            return self
        xf, qf = x.detach().reshape(-1), xq.detach().reshape(-1)
        sf = None if saturated is None else saturated.detach().reshape(-1)
        sums, mx = _pass(xf, qf, sf, exact=False)
        if not bool(torch.isfinite(sums).all()):
            ok = torch.isfinite(xf) & torch.isfinite(qf)
            kept = int(ok.sum())
            self.nan_orig += int(torch.isnan(xf).sum())
            self.nan_quant += int(torch.isnan(qf).sum())
            self.nonfinite += xf.numel() - kept
            if kept < xf.numel():
                xf, qf, sf = xf[ok], qf[ok], None if sf is None else sf[ok]
            if kept == 0:
                return self
            sums, mx = _pass(xf, qf, sf, exact=True)
        self._add(xf.numel(), sums, mx)
        if sf is not None:
            self.saturation_checked += sf.numel()
        return self

    def _add(self, n: int, sums: torch.Tensor, mx: torch.Tensor) -> None:
        if self._sums is None or self._max is None:
            self._sums, self._max = sums.clone(), mx.clone()
        else:
            self._sums += sums.to(self._sums.device)
            self._max = torch.maximum(self._max, mx.to(self._max.device))
        self.n += n

    def merge(self, other: ErrorStats) -> ErrorStats:
        """Add another accumulator (another tensor, batch or worker) into this one."""
        if other._sums is not None and other._max is not None:
            self._add(other.n, other._sums, other._max)
        self.saturation_checked += other.saturation_checked
        self.nan_orig += other.nan_orig
        self.nan_quant += other.nan_quant
        self.nonfinite += other.nonfinite
        return self

    def state(self) -> dict[str, float]:
        """The raw accumulator as plain numbers (JSON-able; `from_state` rebuilds it exactly)."""
        out: dict[str, float] = {
            "n": self.n, "saturation_checked": self.saturation_checked,
            "nan_orig": self.nan_orig, "nan_quant": self.nan_quant, "nonfinite": self.nonfinite,
        }
        sums = self._sums.tolist() if self._sums is not None else [0.0] * len(_SUMS)
        out.update(zip(_SUMS, sums, strict=True))
        out["max_abs_error"] = float(self._max) if self._max is not None else 0.0
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ErrorStats:
        """Inverse of `state()`, e.g. to re-aggregate the rows of a saved report."""
        stats = cls()
        for key in ("n", "saturation_checked", "nan_orig", "nan_quant", "nonfinite"):
            setattr(stats, key, int(state[key]))
        if stats.n:
            stats._sums = torch.tensor([float(state[k]) for k in _SUMS], dtype=torch.float64)
            stats._max = torch.tensor(float(state["max_abs_error"]), dtype=torch.float64)
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


def _pass(xf: torch.Tensor, qf: torch.Tensor, sf: torch.Tensor | None, *, exact: bool):
    """All sums of one flat tensor pair: float64 element math on cache-sized chunks.

    The fast pass counts nonzeros on the inputs and sums |e|/|x| with `nansum`. That is right
    unless some x == 0 has xq != 0 (no quantizer does that; noise can): the sum then comes out
    infinite and the caller reruns with `exact`, which drops x == 0 explicitly.
    """
    chunk = min(_CHUNK, xf.numel())
    buf = torch.empty(4, chunk, dtype=torch.float64, device=xf.device)
    sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=xf.device)
    mx = torch.zeros((), dtype=torch.float64, device=xf.device)
    for start in range(0, xf.numel(), chunk):
        xs, qs = xf[start : start + chunk], qf[start : start + chunk]
        X, Q, A, B = (row[: xs.numel()] for row in buf)
        X.copy_(xs)
        Q.copy_(qs)
        torch.sub(X, Q, out=A)
        v = {"sum_e2": torch.dot(A, A), "sum_xq": torch.dot(X, Q)}
        A.abs_()
        v["sum_abs_e"] = A.sum()
        mx = torch.maximum(mx, A.max())
        torch.abs(X, out=B)
        A.div_(B)  # |e| / |x|: NaN where x == xq == 0, Inf where x == 0 != xq
        if exact:
            v["sum_rel"] = A.nan_to_num_(nan=0.0, posinf=0.0).sum()
            torch.sign(X, out=A)
            torch.sign(Q, out=B)
            v["nonzero"] = torch.dot(A, A)
            v["deadzone"] = v["nonzero"] - torch.dot(B.mul_(A), B)
        else:
            v["sum_rel"] = A.nansum()
            v["nonzero"] = torch.count_nonzero(xs).to(torch.float64)
            v["deadzone"] = v["nonzero"] - torch.count_nonzero(qs)
        for V, tag in ((X, "x"), (Q, "q")):
            torch.mul(V, V, out=A)
            v[f"sum_{tag}"], v[f"sum_{tag}2"] = V.sum(), A.sum()
            v[f"sum_{tag}3"], v[f"sum_{tag}4"] = torch.dot(A, V), torch.dot(A, A)
        v["saturated"] = torch.zeros_like(mx)
        sums += torch.stack([v[k] for k in _SUMS])
    if sf is not None:
        sums[_S["saturated"]] = torch.count_nonzero(sf).to(torch.float64)
    return sums, mx


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
        e = exponents.detach().reshape(-1).to(device="cpu", dtype=torch.int64)
        inside = (e >= self.LOW) & (e <= self.HIGH)
        self.out_of_range += int(e.numel() - inside.sum())
        self.counts += torch.bincount(e[inside] - self.LOW, minlength=self.counts.numel())
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
