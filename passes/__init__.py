"""The passes: one per file. `default_passes()` is the standard pipeline."""

from __future__ import annotations


def default_passes() -> list:
    """Fake-quant first, then noise, then instrumentation (taps see what the model computes)."""
    from qtransform.passes.aqn_noise import AQNNoisePass
    from qtransform.passes.fake_quant import FakeQuantPass
    from qtransform.passes.hw_error import HWErrorPass
    from qtransform.passes.instrument import InstrumentPass

    return [FakeQuantPass(), AQNNoisePass(), HWErrorPass(), InstrumentPass()]
