"""The passes, one per file. Importing this package registers each of them (`register_pass`),
in pipeline order: rotations first (fake quantization sees the rotated tensors), then
fake-quant, then noise, then instrumentation (taps see what the model computes). Each module also registers what it
brings besides its pass (a noise kind)."""

from qtransform.passes.rotate import Rotate, RotatePass  # noqa: I001 - registration order
from qtransform.passes.aqn_noise import AQNNoise, AQNNoisePass
from qtransform.passes.fake_quant import FakeQuantize, FakeQuantPass
from qtransform.passes.hw_error import HWError, HWErrorPass
from qtransform.passes.activation_noise import ActivationNoise, ActivationNoisePass
from qtransform.passes.clamp import Clamp, ClampPass
from qtransform.passes.engine import EngineAttention, EnginePass
from qtransform.passes.instrument import InstrumentPass, Tap

__all__ = ["AQNNoise", "AQNNoisePass", "ActivationNoise", "ActivationNoisePass", "Clamp", "ClampPass", "EngineAttention", "EnginePass",
           "FakeQuantPass", "FakeQuantize", "HWError", "HWErrorPass",
           "InstrumentPass", "Rotate", "RotatePass", "Tap"]
