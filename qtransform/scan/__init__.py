"""Scans: what a format does to a model, measured. Weight scans (weights.py: no forward pass),
activation scans on calibration data (activations.py), the SRDD fault scans (faults.py) and the
per-site sensitivity (sensitivity.py), which all start from one setup (setup.py); the
`ScanReport` they produce (report.py), format comparison (compare.py) and the recommender that
turns a report into a policy (recommend.py)."""

from qtransform.scan import render  # noqa: F401  (registers ScanReport's renderer)
from qtransform.scan.activations import scan_activations
from qtransform.scan.budget import budget_guide, budget_policy, measured_budget
from qtransform.scan.compare import Comparison
from qtransform.scan.faults import gain_scan, instability_scan, kurtosis_scan
from qtransform.scan.recommend import guide, recommend
from qtransform.scan.report import ScanReport
from qtransform.scan.sensitivity import measure_policy, site_sensitivity
from qtransform.scan.sensitivity_report import SensitivityReport
from qtransform.scan.setup import CalibrationSpec, ScanSetup, prepare_scan, scan_policy
from qtransform.scan.weights import compare_formats, scan_weights

__all__ = ["CalibrationSpec", "Comparison", "ScanReport", "ScanSetup", "SensitivityReport",
           "budget_guide", "budget_policy", "compare_formats", "gain_scan", "guide",
           "instability_scan", "kurtosis_scan", "measure_policy", "measured_budget", "prepare_scan",
           "recommend", "scan_activations", "scan_policy", "scan_weights", "site_sensitivity"]
