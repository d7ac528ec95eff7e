"""Calibration: the data (`data.py`: files, the built-in sentences, `--calib` sources,
padding-free batches, `CalibrationSpec`) and the run that calibrates static scales (`run.py`:
`calibrate`, whose observers see real tokens only)."""

from qtransform.calibration.data import (
    BUILTIN,
    MAX_CALIBRATION_BYTES,
    Calibration,
    CalibrationSpec,
    builtin_calibration,
    calibration_batches,
    check_token_ids,
    read_calibration,
    read_source,
)
from qtransform.calibration.run import (
    CalibrationBatches,
    calibrate,
    run_batch,
    run_model,
    token_mask,
    unpadded_positions,
)

__all__ = ["BUILTIN", "MAX_CALIBRATION_BYTES", "Calibration", "CalibrationBatches",
           "CalibrationSpec", "builtin_calibration", "calibrate", "calibration_batches",
           "check_token_ids", "read_calibration", "read_source", "run_batch", "run_model",
           "token_mask", "unpadded_positions"]
