"""`resolve` and its helpers (qtransform/formats/options.py): exact messages and field values.

These pin the options.py mutants that survived `benches/mutation.sh formats`. Every
expected message is written out in full here (matched anchored, with re.escape), and every
expected field value comes from the request, not from the code under test. The registry facts
used (MX takes scale_rule and rounding, NVFP4 rounding and nvfp4_variant, INT rounding; MX
blocks are powers of two from 2 to 1024) are those of registry.py, mx.py, nvfp4.py, intgroup.py.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from qtransform.formats.options import NEUTRAL, QuantConfig, _takers, resolve

MX_FORMATS = "mxfp4, mxfp6_e2m3, mxfp6_e3m2, mxfp8_e4m3, mxfp8_e5m2, mxint8"


def exactly(text: str) -> str:
    """A `match=` pattern for the whole message `text` and nothing else."""
    return f"^{re.escape(text)}$"


# ---- a QuantConfig passes through alone ------------------------------------------------------


@pytest.fixture
def cfg() -> QuantConfig:
    return resolve("mxfp4", rounding="rna")


def test_config_alone_is_returned_unchanged(cfg: QuantConfig) -> None:
    """No options at all: the very same object comes back (block_size None, block_shape None,
    axis -1 are the keyword defaults and must not count as options)."""
    assert resolve(cfg) is cfg


def test_config_with_keyword_defaults_passes(cfg: QuantConfig) -> None:
    """The keywords `fake_quantize` always forwards, at their defaults (the NEUTRAL choices,
    generator None, seed None), are not options: the config comes back unchanged, even though
    its own rounding (rna) differs from the forwarded default (rne)."""
    assert NEUTRAL == {"scale_rule": "floor", "rounding": "rne", "nvfp4_variant": "default",
                       "int_range": "restricted", "scale_dtype": "float32", "fp8_variant": "default",
                       "four_over_six": "none", "global_bound": "448", "four_over_six_order": "pairwise"}
    out = resolve(
        cfg,
        block_size=None,
        axis=-1,
        block_shape=None,
        scale_rule="floor",
        rounding="rne",
        nvfp4_variant="default",
        generator=None,
        seed=None,
    )
    assert out is cfg


@pytest.mark.parametrize(
    "extra",
    [
        {"block_size": 32},
        {"block_shape": (32, 32)},
        {"axis": 0},
        {"axis": 1},
        {"axis": -2},
        {"axis": None},
        {"rounding": "rna"},  # equal to the config's own value, still an option
        {"scale_rule": "ceil"},
        {"nvfp4_variant": "one_level"},
        {"seed": 3},
        {"zero_saturated_grad": True},
    ],
    ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()),
)
def test_config_with_an_option_is_rejected(cfg: QuantConfig, extra: dict[str, Any]) -> None:
    """Each of block_size / block_shape / an axis other than -1 / a non-default option alone is
    enough to refuse the config, with this message (the config's format name first)."""
    with pytest.raises(
        ValueError, match=exactly("mxfp4: pass a QuantConfig alone, or a format name with options")
    ):
        resolve(cfg, **extra)


# ---- axis ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("axis", "shown"), [(True, "True"), (False, "False"), (1.5, "1.5"), ("0", "'0'")]
)
def test_axis_must_be_an_int(axis: Any, shown: str) -> None:
    """A bool is not an int axis (though bool subclasses int), nor is a float or a string."""
    with pytest.raises(ValueError, match=exactly(f"nvfp4: axis must be an int, got {shown}")):
        resolve("nvfp4", axis=axis)


@pytest.mark.parametrize("axis", [None, 0, -2, 3])
def test_axis_int_or_none_is_kept_for_1d_blocks(axis: int | None) -> None:
    got = resolve("int8", axis=axis)
    assert (got.axis, got.block, got.tile) == (axis, 128, None)


# ---- block_shape (2D tiles) ------------------------------------------------------------------


@pytest.mark.parametrize("axis", [None, -1])
def test_tile_fields(axis: int | None) -> None:
    """A non-square tile keeps its (rows, cols) order; the 1D block is 0; the axis is -1
    whether it was left unset (None, as `from_options` passes it) or given as -1."""
    got = resolve("mxfp4", axis=axis, block_shape=(16, 64))
    assert (got.tile, got.block, got.axis) == ((16, 64), 0, -1)
    flipped = resolve("mxfp4", axis=axis, block_shape=(64, 16))
    assert (flipped.tile, flipped.block, flipped.axis) == ((64, 16), 0, -1)


def test_tile_from_a_list() -> None:
    got = resolve("int4", block_shape=[8, 24])
    assert (got.tile, got.block, got.axis) == ((8, 24), 0, -1)
    assert type(got.tile) is tuple


@pytest.mark.parametrize(
    ("shape", "shown"),
    [
        ((True, 32), "(True, 32)"),
        ((32, False), "(32, False)"),
        ((32.0, 32), "(32.0, 32)"),  # 32.0 == 32 is an allowed block: only the type check stops it
        ((32, "32"), "(32, '32')"),
        ((32,), "(32,)"),
        ((32, 32, 32), "(32, 32, 32)"),
        (32, "32"),
    ],
)
def test_tile_must_be_two_ints(shape: Any, shown: str) -> None:
    with pytest.raises(
        ValueError,
        match=exactly(
            f"mxfp4: block_shape must be a 2-tuple of ints such as (32, 32), got {shown}"
        ),
    ):
        resolve("mxfp4", block_shape=shape)


def test_tile_and_block_size_together() -> None:
    with pytest.raises(
        ValueError, match=exactly("nvfp4: pass either block_size or block_shape, not both")
    ):
        resolve("nvfp4", block_shape=(16, 16), block_size=16)


def test_tile_with_another_axis() -> None:
    with pytest.raises(
        ValueError, match=exactly("nvfp4: block_shape tiles the last two dims; leave axis at -1")
    ):
        resolve("nvfp4", block_shape=(16, 16), axis=0)


# ---- unknown options and seed ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "takes"),
    [
        ("mxfp4", "scale_rule, rounding, zero_saturated_grad, seed"),
        ("nvfp4", "rounding, nvfp4_variant, scale_dtype, four_over_six, global_bound, four_over_six_order, "
                  "zero_saturated_grad, seed"),
        ("int4", "rounding, int_range, scale_dtype, zero_saturated_grad, seed"),
    ],
)
def test_unknown_option_lists_what_the_format_takes(fmt: str, takes: str) -> None:
    """The list holds the family's choice options plus the two every format takes, ', '
    separated; 'colour' is close to no option or keyword, so there is no hint."""
    with pytest.raises(
        ValueError, match=exactly(f"{fmt}: unknown option 'colour'; allowed options: {takes}")
    ):
        resolve(fmt, colour="red")


def test_unknown_option_suggests_the_closest() -> None:
    """'sed' vs 'seed': difflib ratio 2*3/7 = 0.86, the best above the 0.5 cutoff."""
    with pytest.raises(
        ValueError,
        match=exactly(
            "int8: unknown option 'sed' (did you mean 'seed'?); "
            "allowed options: rounding, int_range, scale_dtype, zero_saturated_grad, seed"
        ),
    ):
        resolve("int8", sed=1)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "int8"])
def test_seed_reaches_the_config(fmt: str) -> None:
    got = resolve(fmt, rounding="stochastic", seed=1234)
    assert (got.seed, got.rounding, got.stochastic) == (1234, "stochastic", True)
    assert got.options()["seed"] == 1234
    assert resolve(fmt, seed=0).seed == 0
    assert resolve(fmt).seed is None


@pytest.mark.parametrize(
    ("seed", "shown"), [(True, "True"), (False, "False"), (2.0, "2.0"), ("7", "'7'")]
)
def test_seed_must_be_an_int(seed: Any, shown: str) -> None:
    with pytest.raises(ValueError, match=exactly(f"mxfp8_e4m3: seed must be an int, got {shown}")):
        resolve("mxfp8_e4m3", rounding="stochastic", seed=seed)


# ---- choice options --------------------------------------------------------------------------


def test_choice_suggestion_comes_from_the_given_value() -> None:
    """'flor' is nearest 'floor' (ratio 8/9); the text 'None' is near none of the scale rules,
    so the hint must come from the value actually given."""
    with pytest.raises(
        ValueError,
        match=exactly(
            "mxfp4: scale_rule='flor' is not allowed (did you mean 'floor'?); "
            "allowed: floor, rceil, ceil, even, compressed-tensors"
        ),
    ):
        resolve("mxfp4", scale_rule="flor")
    with pytest.raises(
        ValueError,
        match=exactly(
            "nvfp4: nvfp4_variant='one-level' is not allowed (did you mean 'one_level'?); "
            "allowed: default, compressed-tensors, one_level, modelopt, vllm-kv, flashinfer-kv, quartet-ii, vllm"
        ),
    ):
        resolve("nvfp4", nvfp4_variant="one-level")


def test_choice_without_a_close_value_has_no_hint() -> None:
    with pytest.raises(
        ValueError,
        match=exactly("int4: rounding='zzz' is not allowed; allowed: rne, rna, rtz, stochastic"),
    ):
        resolve("int4", rounding="zzz")


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ("mxfp4", {"scale_rule": "floor", "rounding": "rne", "nvfp4_variant": "default"}),
        ("nvfp4", {"scale_rule": "floor", "rounding": "rne", "nvfp4_variant": "default"}),
        ("int8", {"scale_rule": "floor", "rounding": "rne", "nvfp4_variant": "default"}),
    ],
)
def test_choices_not_taken_hold_the_neutral_value(fmt: str, expected: dict[str, str]) -> None:
    """Options the family does not take are filled with floor / rne / default, never None."""
    got = resolve(fmt)
    assert {k: getattr(got, k) for k in expected} == expected


def test_choices_taken_keep_the_given_value() -> None:
    got = resolve("nvfp4", rounding="rna", nvfp4_variant="one_level")
    assert (got.scale_rule, got.rounding, got.nvfp4_variant) == ("floor", "rna", "one_level")
    got = resolve("mxint8", scale_rule="even", rounding="stochastic")
    assert (got.scale_rule, got.rounding, got.nvfp4_variant) == ("even", "stochastic", "default")


def test_neutral_scale_rule_is_accepted_by_every_family() -> None:
    """`fake_quantize`'s signature spells scale_rule='floor', so NVFP4 and INT accept it."""
    assert resolve("nvfp4", scale_rule="floor").scale_rule == "floor"
    assert resolve("int4", scale_rule="floor").scale_rule == "floor"


def test_option_of_another_family_names_the_takers() -> None:
    with pytest.raises(
        ValueError,
        match=exactly(
            f"nvfp4: scale_rule='ceil' applies to MX formats only ({MX_FORMATS}); "
            "nvfp4 has no scale_rule option"
        ),
    ):
        resolve("nvfp4", scale_rule="ceil")
    # only scale_rule's default is let through: nvfp4_variant='default' is refused outside NVFP4
    with pytest.raises(
        ValueError,
        match=exactly(
            "mxfp4: nvfp4_variant='default' applies to NVFP4 formats only (nvfp4); "
            "mxfp4 has no nvfp4_variant option"
        ),
    ):
        resolve("mxfp4", nvfp4_variant="default")


def test_takers_text_for_an_option_of_several_families() -> None:
    """rounding is taken by all three families: their names upper-case, '/' separated, then
    every format in registration order, ', ' separated."""
    assert _takers("rounding") == f"MX/NVFP4/INT/FP8 formats only ({MX_FORMATS}, nvfp4, int4, int8, fp8_e4m3, fp8_e5m2)"
    assert _takers("scale_rule") == f"MX formats only ({MX_FORMATS})"
    assert _takers("nvfp4_variant") == "NVFP4 formats only (nvfp4)"
