"""The encoded form of a fake-quantized tensor: element bit codes plus block (and tensor) scales.

`decode(encode(x))` is bit-identical to `fake_quantize(x)` for deterministic rounding, so the
encoded form is a faithful description of what the simulation computed (for export, inspection
and histograms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qtransform.formats.blocking import BlockLayout, from_blocks, per_block
from qtransform.formats.elements import (
    CANONICAL_NAN,
    decode_elements,
    encode_elements,
    twos_complement,
)
from qtransform.formats.options import QuantConfig, resolve
from qtransform.formats.quantize import canonical_nan_, check_input, quantize_blocks, stream_seed
from qtransform.formats.registry import FormatSpec


@dataclass(frozen=True)
class Encoded:
    """Codes and scales of one tensor.

    codes: uint8 `[n_blocks, block_numel]` element bit codes, sign in bit `bits - 1` (E2M1:
        0..15); int elements are sign-magnitude (see `signed_codes`). Padding codes are 0.
    scales: `[n_blocks]`: MX E8M0 codes (uint8, E + 127, 0xFF = NaN); NVFP4 the E4M3 block
        scale values (fp32); int groups the fp32 group scale.
    tensor_scale: NVFP4 only (fp32, 0-dim): default and modelopt variants the global decode
        scale d (value = code * (scale * d)); compressed-tensors its global scale g
        (value = code * (scale / g)); one_level None.
    """

    config: QuantConfig
    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    layout: BlockLayout
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def format(self) -> str:
        return self.config.spec.name

    def scale_grid(self) -> torch.Tensor:
        """`scales` shaped like the block grid (blocked dim replaced by its block count)."""
        return per_block(self.scales, self.layout)

    def signed_codes(self) -> torch.Tensor:
        """Int elements as ordinary two's complement integers (int8; -0 becomes 0)."""
        return twos_complement(self.codes, self.config.spec.element)


def encode(
    x: torch.Tensor,
    fmt: str | FormatSpec | QuantConfig,
    *,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    **options: Any,
) -> Encoded:
    """Encode x with the same options as `fake_quantize` (the same stochastic stream too)."""
    cfg = resolve(fmt, **options)
    check_input(x, cfg)
    if cfg.int_range != "restricted":
        raise ValueError(
            f"{cfg.name}: encode stores sign-magnitude codes of [-qmax, qmax]; int_range "
            f"{cfg.int_range!r} reaches -(qmax + 1) (and 'modelopt' divides by its multiplier), "
            "so it has no encoded form here: use fake_quantize")
    res, layout = quantize_blocks(x, cfg, stream_seed(cfg, generator, seed, x.device))
    return Encoded(
        config=cfg,
        codes=encode_elements(res.q, cfg.spec.element),
        scales=res.scales,
        tensor_scale=res.tensor_scale,
        layout=layout,
        dtype=x.dtype,
        shape=tuple(x.shape),
    )


def decode(enc: Encoded) -> torch.Tensor:
    """Values of an `Encoded` tensor, in its original dtype and shape."""
    cfg = enc.config
    q = decode_elements(enc.codes, cfg.spec.element)
    scale = cfg.family.scale_values(enc.scales, enc.tensor_scale, cfg)
    out = q * scale[:, None]
    out = torch.where(torch.isnan(out), CANONICAL_NAN, out)
    return canonical_nan_(from_blocks(out, enc.layout).reshape(enc.shape).to(enc.dtype))
