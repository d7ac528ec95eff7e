"""Independent references for tests: float64 MXFP4 and error metrics written from the formulas
in docs/numerics.md and docs/metrics.md (numpy, no qtransform code), so a test that compares
qtransform with them cannot pass by calling the code under test twice."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch


def mxfp4_f64(x: torch.Tensor, axis: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (floor scale rule, ties to even) of finite x in float64: (values as fp32,
    saturation mask). Blocks of 32 along `axis`, each row zero-padded on its own."""
    a = np.moveaxis(x.detach().double().numpy(), axis, -1)
    cols = a.shape[-1]
    padded = np.zeros((*a.shape[:-1], -(-cols // 32) * 32))
    padded[..., :cols] = a
    blocks = padded.reshape(*a.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    _, ex = np.frexp(amax)  # amax = m * 2^ex, m in [0.5, 1): floor(log2(amax)) = ex - 1
    scale = np.ldexp(1.0, np.clip(ex - 1 - 2, -127, 127))  # E = floor_log2(amax) - emax(=2)
    y = blocks / scale
    _, ey = np.frexp(np.abs(y))
    step = np.ldexp(1.0, np.maximum(ey - 1, 0) - 1)  # E2M1: 1 mantissa bit, emin 0
    q = np.minimum(np.round(np.abs(y) / step) * step, 6.0)
    out = np.where(amax == 0, blocks * 0.0, np.copysign(q, y) * scale)
    sat = np.abs(y) > 6.0
    out = out.reshape(padded.shape)[..., :cols]
    sat = sat.reshape(padded.shape)[..., :cols]
    return (torch.from_numpy(np.moveaxis(out, -1, axis).astype(np.float32)),
            torch.from_numpy(np.moveaxis(sat, -1, axis).copy()))


def metrics_f64(x: torch.Tensor, xq: torch.Tensor, sat: torch.Tensor | None = None) -> dict:
    """The headline metrics of docs/metrics.md for finite x, xq, from their float64 formulas."""
    a, b = x.detach().double().numpy().ravel(), xq.detach().double().numpy().ravel()
    e = a - b
    nz = a != 0
    mse = float(np.mean(e**2))
    out = {
        "n": a.size,
        "sqnr_db": 10 * math.log10(float(np.sum(a**2)) / float(np.sum(e**2))),
        "mse": mse,
        "rel_rmse": math.sqrt(mse) / float(np.std(a)),
        "cosine": float(np.dot(a, b)) / math.sqrt(float(np.sum(a**2)) * float(np.sum(b**2))),
        "max_abs_error": float(np.abs(e).max()),
        "deadzone": float(np.sum(nz & (b == 0))) / float(np.sum(nz)),
        "mean_rel_error": float(np.mean(np.abs(e[nz]) / np.abs(a[nz]))),
    }
    if sat is not None:
        out["saturation"] = float(sat.sum()) / a.size
    return out


def assert_metrics(got: dict, want: dict, rel: float = 1e-9) -> None:
    """Each metric of `want` is in `got`, equal up to float64 summation order."""
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=rel, abs=1e-300), key


# -- another library's GEMM -----------------------------------------------------------------

def gemm_rounding(x: torch.Tensor, w: torch.Tensor, ulps: float = 4.0) -> torch.Tensor:
    """Per element of x @ w.T: how far another library's GEMM (onnxruntime's MLAS, vLLM's
    kernels) may land from PyTorch's on the very same operands. Both sum the same K products in
    their own order (block sizes and SIMD width follow the CPU: AVX2 and AVX-512 give different
    last bits), and each partial sum rounds with relative error <= eps of the dtype; over K terms
    the error grows like sqrt(K) (the statistical bound; the worst case is K) times the sum of
    the |products|, not of their signed sum, which may cancel. So: ulps * eps * sqrt(K) *
    (|x| @ |w|.T) + ulps * eps * |x @ w.T| (the bias add and the final rounding). A fake-quant
    or layout mistake moves an output by a quantization step, orders of magnitude more. In
    float64, the dtype of the comparison in `assert_within`."""
    eps = torch.finfo(x.dtype).eps
    k = x.shape[-1]
    xd, wd = x.detach().double(), w.detach().double()
    return ulps * eps * (math.sqrt(k) * (xd.abs() @ wd.abs().T) + (xd @ wd.T).abs())


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    """|got - want| <= bound elementwise, in float64 (the bound from `gemm_rounding`)."""
    err = (got.double() - want.double()).abs()
    worst = float((err / bound.clamp_min(torch.finfo(torch.float64).tiny)).max())
    assert bool((err <= bound).all()), f"{what}: |diff| up to {worst:.3g}x the rounding bound"


# -- "the user's model is untouched" ----------------------------------------------------------

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
          "_load_state_dict_pre_hooks")


def _tensor_record(t: torch.Tensor) -> tuple:
    data = t.detach().to("cpu", copy=True).contiguous()
    return (id(t), type(t), t.dtype, t.device, t.shape, t.requires_grad, data)


def snapshot(model: torch.nn.Module) -> dict:
    """Everything a transform or scan must leave alone on the caller's model: each module object
    (by id) under its name, its class, `training` flag, instance attributes and hook dicts, and
    each parameter and buffer (object, class, dtype, device, shape, requires_grad, a copy of the
    values)."""
    return {
        "modules": {
            name: (id(m), type(m), m.training, sorted(vars(m)),
                   {h: list(getattr(m, h, {}).items()) for h in _HOOKS})
            for name, m in model.named_modules(remove_duplicate=False)
        },
        "parameters": {n: _tensor_record(p) for n, p in
                       model.named_parameters(remove_duplicate=False)},
        "buffers": {n: _tensor_record(b) for n, b in model.named_buffers(remove_duplicate=False)},
    }


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN payloads and signed zeros included)."""
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


def assert_untouched(before: dict, model: torch.nn.Module) -> None:
    """The model is structurally and numerically what `snapshot` saw."""
    after = snapshot(model)
    assert list(after["modules"]) == list(before["modules"]), "modules added, removed or renamed"
    for name, (ident, cls, training, attrs, hooks) in before["modules"].items():
        a_ident, a_cls, a_training, a_attrs, a_hooks = after["modules"][name]
        where = name or "<root>"
        assert a_ident == ident, f"{where}: replaced by another module object"
        assert a_cls is cls, f"{where}: class changed to {a_cls.__name__}"
        assert a_training == training, f"{where}: training flag changed"
        assert a_attrs == attrs, f"{where}: attributes {sorted(set(a_attrs) ^ set(attrs))} changed"
        assert a_hooks == hooks, f"{where}: hooks changed"
    for kind in ("parameters", "buffers"):
        assert list(after[kind]) == list(before[kind]), f"{kind} added, removed or renamed"
        for name, (*meta, data) in before[kind].items():
            *a_meta, a_data = after[kind][name]
            assert a_meta == meta, f"{kind[:-1]} {name}: object, dtype, device or flags changed"
            assert _same_values(a_data, data), f"{kind[:-1]} {name}: values changed"


TOKENIZER_TEXT = ["the quick brown fox jumps over the lazy dog", "a lazy dog sleeps in the sun",
                  "quick thinking wins the day", "over and over the fox runs"]


def tiny_bpe_tokenizer():
    """A byte-level BPE tokenizer trained offline on `TOKENIZER_TEXT` (85 ids, fits build_tiny's
    256): the kind real causal LMs ship, so transformers 5 reloads it beside a Qwen2 or Llama
    config (as Qwen2Tokenizer) with the same ids, which a word-level one does not survive."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TOKENIZER_TEXT, trainers.BpeTrainer(vocab_size=120, show_progress=False,
                                                                special_tokens=["<|endoftext|>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


def register_attention(name: str, function, mask: str = "sdpa") -> str:
    """`function` registered with transformers' attention interface as `name` (with the mask
    function of `mask`): a reference attention a test writes itself."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(name, function)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask])
    return name


def with_implementation(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """A copy of `model` whose attention runs the implementation registered as `name`."""
    import copy

    out = copy.deepcopy(model)
    out.config._attn_implementation_internal = name
    return out
