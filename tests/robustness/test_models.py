"""Silently wrong results: the model loaded without its head, ONNX axes that only look dynamic,
policies that pass plan and break later, half-transformed models, flattened training flags."""

from __future__ import annotations

import copy
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers as tf
from torch import nn

import qtransform
from qtransform.errors import UserError
from qtransform.models import build_tiny, load_model
from qtransform.pipeline import Action, Pass, PassManager, registered_passes
from qtransform.scan.activations import scan_activations
from tests.robustness.conftest import W4A16


@pytest.mark.parametrize(("arch", "cls"), [("gpt2", tf.GPT2LMHeadModel),
                                           ("t5", tf.T5ForConditionalGeneration),
                                           ("qwen2", tf.Qwen2ForCausalLM)])
def test_a_folder_loads_with_the_class_its_config_names(models, arch, cls):
    model = load_model(models[arch])
    assert type(model) is cls
    saved = dict(__import__("safetensors.torch", fromlist=["load_file"]).load_file(
        str(models[arch] / "model.safetensors")))
    for name, value in model.state_dict().items():  # the head too: every tensor the file holds
        if name in saved:
            assert torch.equal(value, saved[name]), name


def test_transformed_t5_is_saved_and_reloaded_with_its_head(cli, models, tmp_path):
    out = tmp_path / "t5-w4"
    result = cli("transform", models["t5"], W4A16, "--out", out)
    assert result.rc == 0, result.stderr
    assert json.loads((out / "config.json").read_text())["architectures"] == ["T5ForConditionalGeneration"]
    reloaded = qtransform.load_transformed(out)
    assert type(reloaded) is tf.T5ForConditionalGeneration
    ids = torch.tensor([[5, 6, 7]])
    original = load_model(models["t5"])
    with torch.no_grad():
        a = reloaded(input_ids=ids, decoder_input_ids=ids).logits
        b = original(input_ids=ids, decoder_input_ids=ids).logits
    assert a.shape == (1, 3, 256) and not torch.equal(a, b)  # logits, and fake-quantized


def test_encoder_decoder_export_and_activation_scan_are_clear_refusals(cli, models, tmp_path):
    cli("export", models["t5"], "--policy", W4A16, "--out", tmp_path / "t5.onnx").assert_user_error(
        "encoder-decoder")
    cli("scan", models["t5"], "--format", "mxfp4", "--calib", "builtin",
        "--out", tmp_path / "s").assert_user_error("encoder-decoder")
    weights = cli("scan", models["t5"], "--format", "mxfp4", "--out", tmp_path / "w")
    assert weights.rc == 0, weights.stderr


def test_exported_dynamic_axes_run_at_other_sizes(cli, tmp_path):
    out = tmp_path / "q.onnx"
    result = cli("export", "builtin:qwen2", "--policy", W4A16, "--out", out, "--batch", "1",
                 "--seq-len", "4", "--no-taps")
    assert result.rc == 0, result.stderr
    model = build_tiny("qwen2")
    transformed = qtransform.transform(model, W4A16).eval()
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(1)
    for batch in (1, 2, 3):
        for length in (1, 5, 11):
            ids = torch.randint(0, 256, (batch, length), generator=gen)
            got = session.run(None, {"input_ids": ids.numpy()})[0]
            with torch.no_grad():
                want = transformed(input_ids=ids).logits.numpy()
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_axis_out_of_range_fails_in_plan(models):
    policy = {"version": 1, "quantize": [{"targets": ["Linear"], "format": "mxfp4", "axis": -3}]}
    with pytest.raises(UserError, match="axis -3 does not exist"):
        qtransform.plan(load_model(models["qwen2"]), policy)


class _FailsOnThird(Pass):
    """A pass whose third insertion fails, after two have changed the model."""

    name = "fails_on_third"
    tag = "boom"
    section = "quantize"
    requires = ("fake_quant",)

    def select(self, program, policy):
        sites = [s for s in program.sites.values() if s.kind == "linear"][:3]
        return [Action(s, "output", "test") for s in sites]

    def build(self, program, action):
        if action.site.name == [s for s in program.sites.values() if s.kind == "linear"][2].name:
            raise RuntimeError("third insertion fails")
        return nn.Identity()


def test_failed_inplace_transform_leaves_the_model_exactly_as_it_was():
    model = build_tiny("qwen2")
    before = copy.deepcopy(model)
    with pytest.raises(RuntimeError, match="third insertion"):
        qtransform.transform(model, W4A16, inplace=True,
                             passes=[*registered_passes(), _FailsOnThird()])
    assert [type(m) for m in model.modules()] == [type(m) for m in before.modules()]
    assert [n for n, _ in model.named_modules()] == [n for n, _ in before.named_modules()]
    for (name, a), (_, b) in zip(model.state_dict().items(), before.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert qtransform.insertion_log(model) == []
    assert all("forward" not in m.__dict__ for m in model.modules())  # site forwards are gone
    assert PassManager(registered_passes()).order  # the manager itself is reusable


def test_bad_policy_fails_before_the_first_change_inplace(models):
    model = load_model(models["qwen2"])
    kinds = [type(m) for m in model.modules()]
    policy = {"version": 1, "quantize": [{"targets": ["Linear"], "format": "mxfp4"}],
              "instrument": {"targets": ["no_such_site"]}}
    with pytest.raises(UserError, match="no_such_site"):
        qtransform.transform(model, policy, inplace=True)
    assert [type(m) for m in model.modules()] == kinds


def test_scans_restore_each_modules_training_flag():
    model = build_tiny("qwen2").train()
    norms = [m for n, m in model.named_modules() if n.endswith("norm")]
    for m in norms:
        m.eval()  # frozen norms, a common fine-tuning setup
    flags = {n: m.training for n, m in model.named_modules()}
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    scan_activations(model, "mxfp4", ids)
    assert {n: m.training for n, m in model.named_modules()} == flags
    assert not all(flags.values()) and any(flags.values())


def test_huge_layer_range_and_regex_selectors_plan_at_once(cli, models, tmp_path):
    policy = tmp_path / "p.json"
    policy.write_text(json.dumps({"version": 1, "quantize": [
        {"targets": ["re:.*mlp\\..*"], "layers": "0-99999999999", "format": "mxfp4"}]}))
    result = cli("plan", models["qwen2"], policy, "--json", timeout=60)  # a hang is rc -9
    assert result.rc == 0, result.stderr
    sites = json.loads(result.stdout)["sites"]
    chosen = sorted(s["name"] for s in sites if s["actions"])
    assert chosen == sorted(s["name"] for s in sites if ".mlp." in s["name"] and s["kind"] == "linear")
    assert len(chosen) == 6  # gate, up, down in each of the 2 layers


def test_policy_on_endless_stdin_is_one_line(tmp_path):
    import subprocess
    import sys

    with open("/dev/zero", "rb") as zero:
        proc = subprocess.run([sys.executable, "-m", "qtransform.cli.main", "policy", "validate", "-"],
                              stdin=zero, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "MiB" in proc.stderr and "Traceback" not in proc.stderr
