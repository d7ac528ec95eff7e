"""`"preset_options"`: a preset's own switches, checked against its list, building its content."""

from __future__ import annotations

import pytest

from qtransform.schemas import PolicyError, load_policy
from qtransform.schemas.presets import Preset, PresetOption, expand, register_preset


def build(options):
    rounding = "stochastic" if options["stochastic"] else "rne"
    return {"quantize": [{"name": "demo/W4 weights", "format": "nvfp4", "rounding": rounding,
                          "block_size": options["block"] and int(options["block"])}]}


OPTIONS = (PresetOption("stochastic", False, "round stochastically"),
           PresetOption("block", None, "block length", choices=(None, "16", "32")))
DEMO = Preset("demo/W4", "a demo", "", build({"stochastic": False, "block": None}), OPTIONS, build)


def test_options_build_the_content_and_stay_in_the_expansion():
    out = expand({"preset": "demo/W4", "preset_options": {"stochastic": True}}, DEMO)
    assert out["quantize"][0]["rounding"] == "stochastic"
    assert out["quantize"][0]["block_size"] is None
    assert out["preset_options"] == {"stochastic": True}
    assert expand({"preset": "demo/W4"}, DEMO)["quantize"][0]["rounding"] == "rne"
    assert "preset_options" not in expand({"preset": "demo/W4"}, DEMO)
    # the user's fields still merge over the built content
    user = {"preset": "demo/W4", "preset_options": {"block": "32"},
            "quantize": [{"name": "demo/W4 weights", "rounding": "rna"}]}
    (rule,) = expand(user, DEMO)["quantize"]
    assert (rule["rounding"], rule["block_size"]) == ("rna", 32)


@pytest.mark.parametrize(("options", "message"), [
    ({"stochastik": True}, "preset_options.stochastik: not an option of preset demo/W4"),
    ({"stochastic": "yes"}, "preset_options.stochastic: expected true or false"),
    ({"block": "64"}, "preset_options.block: not an allowed value"),
    (["stochastic"], "preset_options: expected an object of the preset's options"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(Exception, match=message.replace(".", r"\.")):
        expand({"preset": "demo/W4", "preset_options": options}, DEMO)


def test_register_refuses_content_that_is_not_the_defaults_build():
    with pytest.raises(ValueError, match="content must be what build"):
        register_preset(Preset("demo/bad", "bad", "", {"quantize": []}, OPTIONS, build))
    with pytest.raises(ValueError, match="options and build come together"):
        register_preset(Preset("demo/bad", "bad", "", {"quantize": []}, OPTIONS))


def test_policy_level_errors_are_one_line():
    with pytest.raises(PolicyError, match=r'preset_options: only used with a preset; got \{"x": true\} \(add "preset"'):
        load_policy({"preset_options": {"x": True}})
    with pytest.raises(PolicyError, match=r"preset_options\.x: not an option of preset "
                                          r"llm-compressor/NVFP4A16 \(it has none\)"):
        load_policy({"preset": "llm-compressor/NVFP4A16", "preset_options": {"x": True}})
