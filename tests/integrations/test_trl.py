"""TRL: GRPOTrainer runs a W4A16 NVFP4 + LoRA + AQN policy for a few steps; its rollouts see the
norm noise at the scheduled sigma and its loss forwards see none. The sigma each forward used is
read back from the final norm's input and output (float64) and compared with the schedule and the
documented noise draw, not with qtransform's counters."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerState

import qtransform
from tests.rl.test_rl_core import documented_z
from tests.tiny_rl import prompts, tiny_qwen2, tiny_tokenizer

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

from qtransform.formats import fake_quantize  # noqa: E402
from qtransform.integrations.trl import QTransformCallback, attach  # noqa: E402

VLLMGeneration = pytest.importorskip("trl.generation.vllm_generation").VLLMGeneration

SCHEDULE = {"kind": "exponential", "sigma_start": 0.05, "sigma_end": 0.005, "num_stages": 4,
            "total_steps": 4}  # one step per interval: step 0 clean, then 0.05, 0.0158, 0.005
POLICY = {"version": 1,
          "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4"}],
          "noise": {"targets": ["RMSNorm"], "schedule": SCHEDULE, "seed": 5}}


def scheduled(step: int) -> float:
    return 0.0 if step == 0 else 0.05 * 0.1 ** ((min(step, 3) - 1) / 2)


def sigma_of_call(norm: torch.nn.Module, x: torch.Tensor, out: torch.Tensor, z: torch.Tensor) -> float:
    """The sigma with out = (w + sigma z) * x / rms(x), least squares over the whole call."""
    x64 = x.detach().double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    residual = out.detach().double() - norm.weight.detach().double() * normed
    basis = z.double() * normed
    return float((residual * basis).sum() / (basis * basis).sum())


def grpo(tmp_path, max_steps: int, **config) -> tuple:
    model = qtransform.transform(tiny_qwen2(), POLICY)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=max_steps,
        per_device_train_batch_size=2, num_generations=2, max_completion_length=4,
        logging_steps=1, learning_rate=1e-2, save_strategy="no", seed=0, temperature=1.0,
        **config,
    )
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
        args=args, train_dataset=datasets.Dataset.from_dict({"prompt": prompts(8)}),
        processing_class=tiny_tokenizer(),
        peft_config=peft.LoraConfig(r=4, target_modules="all-linear", lora_alpha=8),
    )
    return model, trainer


def test_grpo_rollouts_see_the_scheduled_noise_and_the_loss_does_not(tmp_path):
    model, trainer = grpo(tmp_path, max_steps=3)
    callback = attach(trainer)
    norm = model.model.norm
    calls = []

    def record(module, inputs, output):
        step = trainer.state.global_step
        z = documented_z(5, "model.norm", step, module.weight.shape)
        calls.append((step, inputs[0].shape[1], torch.is_grad_enabled(),
                      sigma_of_call(module, inputs[0], output, z)))

    norm.register_forward_hook(record)
    trainer.train()

    decode = [(step, s) for step, length, grad, s in calls if length == 1 and not grad]
    loss = [s for _, _, grad, s in calls if grad]
    assert {step for step, _ in decode} == {0, 1, 2} and loss
    for step, s in decode:  # every decoding forward of a rollout: noise at the step's sigma
        assert s == pytest.approx(scheduled(step), rel=1e-3, abs=1e-6), step
    assert max(abs(s) for s in loss) < 1e-6  # the loss forward is clean
    assert callback.noise.current_step == 3  # stepped once per optimizer step

    logged = [h for h in trainer.state.log_history if "loss" in h]  # one per optimizer step
    measured = [next(s for step, s in decode if step == h["step"] - 1) for h in logged]
    # each row's sigma is the one its rollouts were generated at (step k's row: sigma(k)),
    # not the controller's after the step
    assert [h["qtransform/sigma"] for h in logged] == pytest.approx(measured, rel=1e-3, abs=1e-6)
    assert [h["qtransform/sigma"] for h in logged] == pytest.approx([scheduled(s) for s in (0, 1, 2)])
    last = logged[-1]
    assert last["qtransform/noised_forwards"] > 0 and last["qtransform/syncs"] == 0


@pytest.mark.parametrize("hook", ["attach", "callbacks"])
def test_each_row_logs_the_sigma_its_rollouts_were_generated_at(tmp_path, hook):
    # two optimizer steps per generation with attach: rows 1 and 2 train on step 0's rollouts;
    # the plain callback sees no generation and reports the sigma at the start of each step
    model, trainer = grpo(tmp_path, max_steps=3, steps_per_generation=2 if hook == "attach" else 1)
    if hook == "attach":
        attach(trainer, weight_stats_every=0)
    else:
        trainer.add_callback(QTransformCallback(model, weight_stats_every=0))
    norm, generated = model.model.norm, []

    def record(module, inputs, output):
        if inputs[0].shape[1] == 1 and not torch.is_grad_enabled():  # a decoding step
            step = trainer.state.global_step
            z = documented_z(5, "model.norm", step, module.weight.shape)
            generated.append((step, sigma_of_call(module, inputs[0], output, z)))

    norm.register_forward_hook(record)
    trainer.train()
    rows = [h for h in trainer.state.log_history if "loss" in h]
    steps = sorted({step for step, _ in generated})
    assert steps == ([0, 2] if hook == "attach" else [0, 1, 2])
    for row in rows:  # the latest generation at or before the row's step
        source = max(s for s in steps if s <= row["step"] - 1)
        used = [s for step, s in generated if step == source]
        assert row["qtransform/sigma"] == pytest.approx(used[0], rel=1e-3, abs=1e-6)
        assert row["qtransform/sigma"] == pytest.approx(scheduled(source))


def test_a_policy_without_noise_logs_nothing_and_a_resumed_run_continues_the_schedule():
    model = qtransform.transform(tiny_qwen2(), {"version": 1, "quantize": POLICY["quantize"]})
    state = TrainerState(global_step=2)
    callback = QTransformCallback(model)
    callback.on_train_begin(None, state, None)
    assert callback.noise is None and callback.metrics() == {}
    callback = QTransformCallback(qtransform.transform(tiny_qwen2(), POLICY))
    callback.on_train_begin(None, state, None)
    assert callback.metrics()["qtransform/sigma"] == pytest.approx(scheduled(2))


class StreamOnly(VLLMGeneration):
    """TRL's own VLLMGeneration without its engine (vLLM is not in this environment): the
    parameter stream `_iter_named_params` that both vLLM modes sync from is TRL's code."""

    def _init_vllm(self) -> None:
        pass


def test_trls_vllm_sync_stream_carries_the_rollout_weights(tmp_path):
    model, trainer = grpo(tmp_path, max_steps=1)
    for name, p in trainer.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)  # a trained adapter
    trainer.use_vllm = True
    trainer.vllm_generation = StreamOnly(model=trainer.model, accelerator=trainer.accelerator,
                                         processing_class=trainer.processing_class)
    attach(trainer)
    qtransform.noise_controller(model).set_step(2)
    synced = dict(trainer.vllm_generation._iter_named_params())
    assert list(synced) == [n for n, _ in tiny_qwen2().named_parameters()]

    layer = trainer.model.base_model.model.model.layers[1].self_attn.q_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    dense = fake_quantize(layer.base_layer.weight.detach(), "nvfp4", axis=-1) + (b @ a * layer.scaling["default"]).detach()
    torch.testing.assert_close(synced["model.layers.1.self_attn.q_proj.weight"], dense, rtol=0, atol=1e-6)
    # TRL merged W + s B A into the base and unmerged it after: the stream is the model after the sync
    direct = dict(qtransform.rollout_weights(model))
    assert all(torch.equal(synced[k], direct[k]) for k in synced)
    w = model.model.norm.weight.detach()
    torch.testing.assert_close(synced["model.norm.weight"],
                               w + scheduled(2) * documented_z(5, "model.norm", 2, w.shape),
                               rtol=0, atol=1e-6)
    assert torch.equal(synced["lm_head.weight"], model.lm_head.weight)  # not in the policy
