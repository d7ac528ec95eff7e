"""Scans: what a format does to a model, measured. Weight scans (weights.py: no forward pass),
activation scans on calibration data (activations.py), the SRDD fault scans (faults.py), the
`ScanReport` they produce (report.py), format comparison (compare.py) and the recommender that
turns a report into a policy (recommend.py)."""

from qtransform.scan.activations import scan_activations
from qtransform.scan.compare import Comparison
from qtransform.scan.faults import gain_scan, instability_scan, kurtosis_scan
from qtransform.scan.recommend import guide, recommend
from qtransform.scan.report import ScanReport
from qtransform.scan.weights import compare_formats, scan_weights

__all__ = ["Comparison", "ScanReport", "compare_formats", "gain_scan", "guide", "instability_scan",
           "kurtosis_scan", "recommend", "scan_activations", "scan_weights"]
