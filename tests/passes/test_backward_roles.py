"""A quantize rule's `backward`: per-role quantization of a Linear's backward GEMMs.

Every mode is checked against an implementation written here with explicit torch ops: the
operands quantized by `formats.fake_quantize` along the stated axes of the untransposed tensors
(W along axis 0 = the output features; G and X along axis 0 = the tokens), the Hadamard
rotation built by hand, and dX, dW computed by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qtransform
from qtransform import formats
from qtransform.core.backward import BackwardLinear
from qtransform.core.lora import dense_weight
from qtransform.core.streams import DrawStream
from qtransform.errors import UserError
from qtransform.formats import philox
from qtransform.schemas import PolicyError, load_policy

IN, OUT, BATCH, SEQ = 64, 32, 2, 24  # 48 tokens


def _policy(fmt: str = "mxfp4", **rule) -> dict:
    return {"version": 1, "quantize": [{"targets": ["Linear"], "format": fmt,
                                        "tensors": ["weight", "input"], **rule}]}


def _run(model: nn.Module, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(dX, dW, dB) of the loss sum(y * r): the upstream gradient G is r itself."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    (model(x) * r).sum().backward()
    lin = getattr(model, "_orig_mod", model)[0]  # torch.compile wraps the model
    return x.grad, lin.weight.grad, lin.bias.grad


def _data(dtype: torch.dtype = torch.float32, tokens: int = SEQ, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, OUT)).to(dtype)
    x = torch.randn(BATCH, tokens, IN, dtype=dtype)
    r = torch.randn(BATCH, tokens, OUT, dtype=dtype)
    return model, x, r


def _signs(b: int, seed: int) -> torch.Tensor:
    u = philox.uniform_at(seed, torch.arange(b, dtype=torch.int64))
    return torch.where(u < 0.5, torch.tensor(1.0), torch.tensor(-1.0))


def _sylvester(b: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(b)).to(torch.float32)


def _rotate_tokens(m: torch.Tensor, b: int, signs: torch.Tensor | None) -> torch.Tensor:
    """m [N, F] rotated along N (the tokens) per block of b, N zero-padded to a multiple of b;
    returned as [F, N'] (rows = features)."""
    n = m.shape[0]
    pad = -n % b
    mt = torch.cat([m.t(), m.new_zeros(m.shape[1], pad)], 1) if pad else m.t()
    blocks = mt.to(torch.float32).reshape(mt.shape[0], -1, b)
    if signs is not None:
        blocks = blocks * signs
    return (blocks @ _sylvester(b)).reshape(mt.shape).to(m.dtype)


def _reference(x, w, g, grad_q=None, weight_q=None, input_q=None, hadamard=None):
    """dX, dW by hand; *_q = (format, options) or None for an unquantized operand; `hadamard`
    = (block, signs) rotates G and X along the tokens before they are quantized."""
    g2, x2 = g.reshape(-1, w.shape[0]), x.reshape(-1, w.shape[1])
    fq = formats.fake_quantize
    gd = g2 if grad_q is None else fq(g2, grad_q[0], axis=-1, **grad_q[1])  # along out features
    # W along the output features (a 2-D tile covers both orientations: W itself)
    wd = w if weight_q is None else fq(w, weight_q[0], **({} if "block_shape" in weight_q[1] else {"axis": 0}),
                                       **weight_q[1])
    dx = (gd @ wd).reshape(x.shape)
    if hadamard is None:
        gt = g2 if grad_q is None else fq(g2, grad_q[0], axis=0, **grad_q[1])  # along tokens
        xt = x2 if input_q is None else fq(x2, input_q[0], axis=0, **input_q[1])
        dw = gt.t() @ xt
    else:
        b, signs = hadamard
        gr, xr = _rotate_tokens(g2, b, signs), _rotate_tokens(x2, b, signs)  # [F, N'] each
        gq = gr if grad_q is None else fq(gr, grad_q[0], axis=-1, **grad_q[1])
        xq = xr if input_q is None else fq(xr, input_q[0], axis=-1, **input_q[1])
        dw = gq @ xq.t()
    return dx, dw


ROLE_FORMATS = [("nvfp4", {}), ("mxfp4", {}), ("mxfp4", {"scale_rule": "rceil"}),
                ("mxfp8_e4m3", {})]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fmt", "opts"), ROLE_FORMATS)
def test_quantized_backward_equals_the_hand_computed_gemms(fmt, opts, dtype):
    model, x, r = _data(dtype)
    role = {"format": fmt, **opts}
    t = qtransform.transform(model, _policy(fmt, backward="quantized", backward_roles={
        "grad": role, "weight": role, "input": role}))
    dx, dw, db = _run(t, x, r)
    want_dx, want_dw = _reference(x, model[0].weight.detach(), r, (fmt, opts), (fmt, opts), (fmt, opts))
    assert torch.equal(dx, want_dx)
    assert torch.equal(dw, want_dw)
    assert dx.dtype == dw.dtype == dtype
    assert torch.equal(db, r.reshape(-1, OUT).sum(0))  # the bias from the unquantized G
    assert not torch.equal(dw, r.reshape(-1, OUT).t() @ x.reshape(-1, IN))  # quantization acted


@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(1, 70), features=st.sampled_from([(16, 48), (64, 32), (40, 24)]),
       fmt=st.sampled_from(["nvfp4", "mxfp4", "mxfp8_e4m3"]), hadamard=st.sampled_from([None, 4, 16]),
       seed=st.integers(0, 2**31))
def test_quantized_backward_equals_the_reference_on_any_shape(tokens, features, fmt, hadamard, seed):
    """Any token count (blocks and Hadamard blocks padded), any feature sizes (rows padded)."""
    n_in, n_out = features
    torch.manual_seed(seed)
    lin = nn.Linear(n_in, n_out)
    x, r = torch.randn(1, tokens, n_in), torch.randn(1, tokens, n_out)
    rule = {"backward": "quantized"} | ({"wgrad_hadamard": {"block_size": hadamard, "seed": seed}}
                                       if hadamard else {})
    t = qtransform.transform(nn.Sequential(lin), _policy(fmt, **rule))
    xi = x.clone().requires_grad_(True)
    (t(xi) * r).sum().backward()
    q = (fmt, {})
    want = _reference(x, lin.weight.detach(), r, q, q, q,
                      hadamard=(hadamard, _signs(hadamard, seed)) if hadamard else None)
    assert torch.equal(xi.grad, want[0])
    assert torch.equal(t[0].weight.grad, want[1])


@pytest.mark.parametrize("tokens", [SEQ, 20])  # 48 tokens, and 40 (padded to 48 for the rotation)
@pytest.mark.parametrize("kind", ["random_hadamard", "hadamard"])
def test_wgrad_hadamard_rotates_both_operands_along_the_tokens(kind, tokens):
    model, x, r = _data(tokens=tokens)
    nv = ("nvfp4", {})
    hadamard = {"kind": kind, "block_size": 16} | ({"seed": 7} if kind == "random_hadamard" else {})
    t = qtransform.transform(model, _policy("nvfp4", backward="quantized", backward_roles={
        "grad": {"format": "nvfp4"}, "weight": {"format": "nvfp4", "block_shape": [16, 16]},
        "input": {"format": "nvfp4"}}, wgrad_hadamard=hadamard))
    dx, dw, _ = _run(t, x, r)
    signs = _signs(16, 7) if kind == "random_hadamard" else None
    want_dx, want_dw = _reference(x, model[0].weight.detach(), r, nv, ("nvfp4", {"block_shape": (16, 16)}),
                                  nv, hadamard=(16, signs))
    assert torch.equal(dx, want_dx)
    assert torch.equal(dw, want_dw)
    # unquantized, the rotation changes dW by rounding only: R is orthogonal
    exact = r.reshape(-1, OUT).t().double() @ x.reshape(-1, IN).double()
    assert (dw.double() - exact).abs().max() < 0.5 * exact.abs().max()


def test_a_role_left_out_stays_unquantized_and_weight_forward_reuses_the_forward_copy():
    model, x, r = _data()
    t = qtransform.transform(model, _policy("nvfp4", backward="quantized", backward_roles={
        "grad": {"format": "mxfp8_e4m3"}, "weight": "forward"}))
    dx, dw, _ = _run(t, x, r)
    w = model[0].weight.detach()
    wq = formats.fake_quantize(w, "nvfp4")  # the forward's weight: blocks along the input features
    g2 = r.reshape(-1, OUT)
    assert torch.equal(dx, (formats.fake_quantize(g2, "mxfp8_e4m3") @ wq).reshape(x.shape))
    gt = formats.fake_quantize(g2, "mxfp8_e4m3", axis=0)
    assert torch.equal(dw, gt.t() @ x.reshape(-1, IN))  # X unquantized in wgrad


def test_null_roles_quantize_every_operand_in_the_rules_format():
    model, x, r = _data()
    t = qtransform.transform(model, _policy("mxfp4", backward="quantized"))
    mx = ("mxfp4", {})
    want = _reference(x, model[0].weight.detach(), r, mx, mx, mx)
    got = _run(t, x, r)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_high_precision_equals_the_unquantized_linears_gradients(dtype):
    model, x, r = _data(dtype)
    t = qtransform.transform(model, _policy("nvfp4", backward="high_precision"))
    got, plain = _run(t, x, r), _run(model, x, r)
    for a, b in zip(got, plain, strict=True):
        assert torch.equal(a, b)
    y_q, y = t(x), model(x)
    assert not torch.equal(y_q, y)  # the forward is still quantized


def test_dequantized_is_todays_straight_through_and_leaves_the_graph_as_it_was():
    model, x, r = _data()
    default, explicit = (qtransform.transform(model, _policy("mxfp4", **extra))
                         for extra in ({}, {"backward": "dequantized"}))
    got = _run(explicit, x, r)
    assert all(torch.equal(a, b) for a, b in zip(got, _run(default, x, r), strict=True))
    w, x2, g2 = model[0].weight.detach(), x.reshape(-1, IN), r.reshape(-1, OUT)
    assert torch.equal(got[0], (g2 @ formats.fake_quantize(w, "mxfp4")).reshape(x.shape))
    assert torch.equal(got[1], g2.t() @ formats.fake_quantize(x2, "mxfp4"))
    assert not any(isinstance(m, BackwardLinear) for m in explicit.modules())


def _stochastic_grad_model(seed: int = 3):
    model, x, r = _data()
    t = qtransform.transform(model, _policy("mxfp4", backward="quantized", backward_roles={
        "grad": {"format": "mxfp4", "scale_rule": "rceil", "rounding": "stochastic", "seed": seed}}))
    backward = next(m for m in t.modules() if isinstance(m, BackwardLinear))
    return model, t, backward, x, r


def test_stochastic_gradient_rounding_is_unbiased():
    """rceil never saturates, so E[Q(G)] = G: the mean of dX and dW over K independent steps
    converges to G·W and Gᵀ·X. Each element's mean is within 6 standard errors (estimated from
    the same K samples) of the exact value, and the z-scores over all elements have mean ~0
    (|mean z| < 6/sqrt(n)) and variance ~1: a biased rounding (e.g. the seed era's x/2) fails
    by hundreds of standard errors."""
    model, t, backward, x, r = _stochastic_grad_model()
    k = 300
    samples = {0: [], 1: []}
    for step in range(k):
        backward.set_step(step)
        got = _run(t, x, r)
        samples[0].append(got[0].double())
        samples[1].append(got[1].double())
    w = model[0].weight.detach().double()
    g2, x2 = r.reshape(-1, OUT).double(), x.reshape(-1, IN).double()
    exact = {0: (g2 @ w).reshape(x.shape), 1: g2.t() @ x2}
    for i, want in exact.items():
        s = torch.stack(samples[i])
        se = s.std(0) / math.sqrt(k)
        z = ((s.mean(0) - want) / se).flatten()
        assert z.abs().max() < 6
        assert abs(z.mean()) < 6 / math.sqrt(z.numel())
        assert 0.7 < z.var() < 1.4
        assert (s.std(0) > 0).float().mean() > 0.9  # it is stochastic


def test_stochastic_gradient_rounding_is_reproducible_per_step_and_fresh_per_call():
    _, t, backward, x, r = _stochastic_grad_model()
    backward.set_step(5)
    first, second = _run(t, x, r), _run(t, x, r)  # two calls of one step: distinct draws
    backward.set_step(5)
    again = _run(t, x, r)
    backward.set_step(6)
    other = _run(t, x, r)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[1], second[1])
    assert not torch.equal(first[0], other[0])
    # the documented stream: the draws of call 0 at step 5 are seed site_seed(3, "<label>/<operand>", 5, 0)
    g2 = r.reshape(-1, OUT)
    stream = DrawStream(3, "0/backward/grad_dgrad")
    stream.set_step(5)
    seed = stream.seed_at(0)
    gq = formats.fake_quantize(g2, "mxfp4", scale_rule="rceil", rounding="stochastic", seed=seed)
    w = t[0].weight.detach()
    assert torch.equal(first[0], (gq @ w).reshape(x.shape))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_replays_the_stochastic_gradient_draws(reentrant):
    """torch.utils.checkpoint recomputes the forward inside backward: the recomputed forward
    takes the draw index of the one it replays, so the gradients equal those without
    checkpointing bit for bit (stochastic rounding forward and backward)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(IN, IN), nn.GELU(), nn.Linear(IN, OUT))
    policy = _policy("mxfp4", rounding="stochastic", seed=1, backward="quantized", backward_roles={
        "grad": {"format": "mxfp4", "rounding": "stochastic", "seed": 2},
        "weight": {"format": "mxfp4"}, "input": {"format": "mxfp4", "rounding": "stochastic"}})
    x = torch.randn(BATCH, SEQ, IN)
    r = torch.randn(BATCH, SEQ, OUT)
    grads = []
    for checkpointed in (False, True):
        t = qtransform.transform(base, policy)
        for _ in range(2):  # two steps' forwards and backwards
            xi = x.clone().requires_grad_(True)
            if checkpointed:
                y = torch.utils.checkpoint.checkpoint(t, xi, use_reentrant=reentrant)
            else:
                y = t(xi)
            (y * r).sum().backward()
        grads.append([xi.grad] + [p.grad for p in t.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_graph_mode_computes_the_same_gradients():
    model, x, r = _data()
    policy = _policy("nvfp4", backward="quantized", wgrad_hadamard={"block_size": 16})
    module, graph = (qtransform.transform(model, policy, x, mode=mode) for mode in ("module", "graph"))
    assert any(isinstance(m, BackwardLinear) for m in graph.modules())
    got = []
    for t in (module, graph):
        xi = x.clone().requires_grad_(True)
        (t(xi) * r).sum().backward()
        weight = dict(t.named_parameters())["0.weight"]
        got.append((xi.grad, weight.grad))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


def test_export_sees_the_forward_linear():
    model, x, _ = _data()
    t = qtransform.transform(model, _policy("mxfp4", backward="quantized"))
    ep = torch.export.export(t, (x,), strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.linear.default in targets
    assert torch.equal(ep.module()(x), t(x))


@pytest.mark.parametrize(("rule", "path", "words"), [
    ({"backward_roles": {"grad": {"format": "nvfp4"}}}, "quantize[0].backward_roles",
     'only used with backward "quantized"'),
    ({"backward": "high_precision", "wgrad_hadamard": {}}, "quantize[0].wgrad_hadamard",
     'only used with backward "quantized"'),
    ({"backward": "quantized", "wgrad_hadamard": {"block_size": 12}},
     "quantize[0].wgrad_hadamard.block_size", "power of two"),
    ({"backward": "quantized", "wgrad_hadamard": {"kind": "hadamard", "seed": 1}},
     "quantize[0].wgrad_hadamard.seed", "random_hadamard"),
    ({"backward": "quantized", "backward_roles": {"grad": {"format": "nvpf4"}}},
     "quantize[0].backward_roles.grad.format", "did you mean 'nvfp4'"),
    ({"backward": "quantized", "backward_roles": {"input": {"format": "nvfp4", "block_shape": [16, 16]}}},
     "quantize[0].backward_roles.input.block_shape", "weight role only"),
    ({"backward": "quantized", "backward_roles": {"grad": {"format": "mxfp4", "scale_rule": "rciel"}}},
     "quantize[0].backward_roles.grad.scale_rule", "did you mean 'rceil'"),
    ({"backward": "quantized", "backward_roles": {"grad": {"format": "mxfp4", "seed": 1}}},
     "quantize[0].backward_roles.grad.seed", "stochastic"),
    ({"backward": "quantized", "backward_roles": {"weight": "fwd"}},
     "quantize[0].backward_roles.weight", "forward"),
    ({"backward": "quantised"}, "quantize[0].backward", "did you mean 'quantized'"),
    ({"backward": "quantized", "zero_saturated_grad": True}, "quantize[0].zero_saturated_grad",
     "straight-through"),
    ({"backward": "high_precision", "lora": "merged"}, "quantize[0].lora", "beside"),
])
def test_bad_backward_fields_name_their_path(rule, path, words):
    with pytest.raises(PolicyError) as err:
        load_policy(_policy("nvfp4", **rule))
    assert f"{path}:" in str(err.value)
    assert words in str(err.value)


def test_two_rules_asking_one_site_for_different_backwards_are_refused():
    policy = {"version": 1, "quantize": [
        {"targets": ["Linear"], "format": "mxfp4", "tensors": ["weight"], "backward": "high_precision"},
        {"targets": ["Linear"], "format": "mxfp4", "tensors": ["input"], "backward": "quantized"}]}
    model, _, _ = _data()
    with pytest.raises(UserError, match="different backward"):
        qtransform.transform(model, policy)


@pytest.mark.parametrize("order", ["peft_first", "transform_first"])
def test_peft_lora_base_gemms_quantized_adapters_in_full_precision(order):
    """Under PEFT LoRA the frozen base weight gets no gradient (no wgrad GEMM runs); the base
    layer's dgrad is quantized, dX_base = Q(G)·Q(W); the adapters A and B are separate Linears
    the rule does not select, so their GEMMs are plain autograd on the unquantized G and x:
    dB = (sG)ᵀ(Ax), dA = (sGB)ᵀx, and dX = dX_base + (sGB)A."""
    peft = pytest.importorskip("peft")
    from qtransform.models import build_tiny

    policy = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4",
                                          "tensors": ["weight", "input"], "backward": "quantized"}]}
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = build_tiny("qwen2")
    if order == "peft_first":
        lora = qtransform.transform(peft.get_peft_model(model, config), policy)
    else:
        lora = peft.get_peft_model(qtransform.transform(model, policy), config)
    layer = lora.base_model.model.model.layers[0].self_attn.q_proj
    torch.nn.init.normal_(layer.lora_B["default"].weight)
    base, a, b = layer.base_layer, layer.lora_A["default"], layer.lora_B["default"]
    s = layer.scaling["default"]
    assert not base.weight.requires_grad
    torch.manual_seed(1)
    x = torch.randn(2, 16, 64, requires_grad=True)
    r = torch.randn(2, 16, base.out_features)
    (layer(x) * r).sum().backward()
    assert base.weight.grad is None
    g2 = r.reshape(-1, base.out_features)
    wq = formats.fake_quantize(base.weight.detach(), "nvfp4", axis=0)
    dx_base = formats.fake_quantize(g2, "nvfp4") @ wq
    # the adapters: plain autograd on an independent copy of their arithmetic
    xa = x.detach().clone().requires_grad_(True)
    wa, wb = a.weight.detach().clone().requires_grad_(True), b.weight.detach().clone().requires_grad_(True)
    (torch.nn.functional.linear(torch.nn.functional.linear(xa, wa), wb) * s * r).sum().backward()
    assert torch.equal(a.weight.grad, wa.grad) and torch.equal(b.weight.grad, wb.grad)
    assert torch.equal(x.grad, dx_base.reshape(x.shape) + xa.grad)
    # rollouts compute with the dense weight quant(W) + s B A, as with the default backward
    default_policy = {**policy, "quantize": [{**policy["quantize"][0], "backward": "dequantized"}]}
    twin_model = build_tiny("qwen2")
    if order == "peft_first":
        default = qtransform.transform(peft.get_peft_model(twin_model, config), default_policy)
    else:
        default = peft.get_peft_model(qtransform.transform(twin_model, default_policy), config)
    twin = default.base_model.model.model.layers[0].self_attn.q_proj
    twin.lora_A["default"].weight.data.copy_(a.weight.data)
    twin.lora_B["default"].weight.data.copy_(b.weight.data)
    ids = torch.randint(0, 100, (1, 4))
    with torch.no_grad(), qtransform.rollout():
        lora(input_ids=ids), default(input_ids=ids)  # PEFT after transform: bound at a model forward
        want = torch.nn.functional.linear(base.input_fake_quant(x), dense_weight(layer), base.bias)
        assert torch.equal(layer(x), want)
        assert torch.equal(twin(x), want)


def test_torch_compile_runs_the_quantized_backward_eagerly():
    """torch.compile: the fake-quants compile to their custom ops, the site's linear runs its own
    backward eagerly (a graph break), so the gradients equal the eager model's."""
    model, x, r = _data()
    t = qtransform.transform(model, _policy("nvfp4", backward="quantized", wgrad_hadamard={}))
    eager = _run(t, x, r)
    compiled = torch.compile(t, backend="aot_eager")
    got = _run(compiled, x, r)
    for a, b in zip(got, eager, strict=True):
        assert torch.equal(a, b)
    straight = _run(qtransform.transform(model, _policy("nvfp4")), x, r)
    assert not torch.equal(got[1], straight[1])  # the quantized backward ran, not the default


def test_onnx_export_is_the_forward_of_the_default_backward(tmp_path):
    """An exported graph carries the forward only: with a quantized backward the ONNX model has
    the same fake-quant nodes and gives the same outputs in onnxruntime as with the default."""
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    model, x, _ = _data()
    outputs, ops = [], []
    for extra in ({}, {"backward": "quantized", "wgrad_hadamard": {}}):
        t = qtransform.transform(model, _policy("nvfp4", **extra))
        path = qtransform.export_onnx(t, tmp_path / f"m{len(outputs)}.onnx", example_inputs=(x,))
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        outputs.append(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
        ops.append(sorted(n.op_type for n in onnx.load(str(path)).graph.node))
    assert ops[0] == ops[1]
    assert (outputs[0] == outputs[1]).all()


def test_the_noise_controller_steps_and_checkpoints_the_gradient_draws():
    """With AQN in the policy, `noise_controller` steps the backward's stream with every other
    stream and its state resumes the exact draws."""
    from qtransform.models import build_tiny

    policy = {"version": 1, "quantize": [{
        "targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4", "backward": "quantized",
        "backward_roles": {"grad": {"format": "mxfp4", "rounding": "stochastic"}}}],
        "noise": {"targets": ["RMSNorm"], "schedule": {"kind": "constant", "sigma_start": 0.01,
                                                      "num_stages": 2, "total_steps": 2}}}
    model = qtransform.transform(build_tiny("qwen2"), policy).train()
    controller = qtransform.noise_controller(model)
    backward = [m for m in model.modules() if isinstance(m, BackwardLinear)]
    assert backward and all(m in controller.others for m in backward)
    ids = torch.randint(0, 100, (1, 8))

    def grads() -> list[torch.Tensor]:
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    controller.step()
    grads()
    state = controller.state_dict()
    assert state["step"] == 1 and state["draws"][backward[0].stream.key] == 1
    want = grads()
    controller.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(grads(), want, strict=True))


def test_the_example_policy_is_transformer_engines_nvfp4_recipe():
    """schemas/examples/nvfp4_w4a4_quantized_backward.json: 16x16 weight tiles reused in dgrad,
    gradients and inputs in 1x16 blocks along each GEMM's reduction axis, stochastic gradient
    rounding, a random Hadamard of 16 tokens on wgrad. With rounding made nearest it equals
    the hand computation exactly."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "schemas" / "examples" / "nvfp4_w4a4_quantized_backward.json"
    policy = json.loads(path.read_text())
    policy["quantize"][1]["backward_roles"]["grad"] = {"format": "nvfp4"}
    for rule in policy["quantize"]:
        rule["ignore"] = []  # a bare Linear has no lm_head
    model, x, r = _data()
    dx, dw, _ = _run(qtransform.transform(model, policy), x, r)
    nv = ("nvfp4", {})
    want = _reference(x, model[0].weight.detach(), r, nv, ("nvfp4", {"block_shape": (16, 16)}), nv,
                      hadamard=(16, _signs(16, 0)))
    assert torch.equal(dx, want[0]) and torch.equal(dw, want[1])


def test_under_autocast_the_backward_gemms_run_in_its_dtype():
    """torch.autocast ran the forward GEMM in bf16: the backward GEMMs take the operands cast to
    bf16 too (then quantized), and the gradients come back in the parameters' dtype; high
    precision equals the unquantized Linear under autocast."""
    model, x, r = _data()

    def grads(m):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(xi)
        (y.float() * r).sum().backward()
        lin = m[0]
        return xi.grad, lin.weight.grad, lin.bias.grad

    high = grads(qtransform.transform(model, _policy("nvfp4", backward="high_precision")))
    assert all(torch.equal(a, b) for a, b in zip(high, grads(model), strict=True))
    quantized = grads(qtransform.transform(model, _policy("mxfp8_e4m3", backward="quantized")))
    g = (r.to(torch.bfloat16))  # the upstream gradient of a bf16 output
    q = ("mxfp8_e4m3", {})
    want = _reference(x.to(torch.bfloat16), model[0].weight.detach().to(torch.bfloat16), g, q, q, q)
    assert quantized[0].dtype == quantized[1].dtype == torch.float32
    assert torch.equal(quantized[0], want[0].float()) and torch.equal(quantized[1], want[1].float())


def test_restoring_an_inplace_transform_removes_the_backward_module():
    from qtransform.pipeline.transform import transform_program

    model, x, r = _data()
    before = _run(model, x, r)
    program = transform_program(model, _policy("nvfp4", backward="quantized"), inplace=True)
    assert any(isinstance(m, BackwardLinear) for m in model.modules())
    program.restore()
    assert not any(isinstance(m, BackwardLinear) for m in model.modules())
    assert "forward" not in model[0].__dict__
    assert all(torch.equal(a, b) for a, b in zip(_run(model, x, r), before, strict=True))


def test_gpt2_conv1d_weights_stored_in_out():
    """GPT-2's Conv1D computes addmm(b, x, W) with W [in, out]: the same backward per role, W's
    roles read as the [out, in] matrix of the Linear it is; high precision equals the
    unquantized Conv1D's gradients; graph mode computes the module mode's gradients."""
    from qtransform.models import build_tiny

    model = build_tiny("gpt2")
    ids = torch.randint(0, 100, (2, 24))
    rule = {"targets": ["Conv1D"], "format": "mxfp4", "tensors": ["weight", "input"]}
    policy = {"version": 1, "quantize": [{**rule, "backward": "quantized"}]}
    t, graph = (qtransform.transform(model, policy, {"input_ids": ids}, mode=mode) for mode in ("module", "graph"))
    assert sum(isinstance(m, BackwardLinear) for m in t.modules()) == 8  # 4 Conv1D x 2 layers
    assert sum(isinstance(m, BackwardLinear) for m in graph.modules()) == 8

    def grads(m):
        m.zero_grad(set_to_none=True)
        logits = m(input_ids=ids, use_cache=False)["logits"]
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        return {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    want = grads(t)
    got = grads(graph)
    assert got.keys() == want.keys() and all(torch.equal(g, want[n]) for n, g in got.items())
    # one Conv1D on its own: against the hand computation, and high precision against the plain one
    conv, plain = t.transformer.h[0].mlp.c_fc, model.transformer.h[0].mlp.c_fc
    high = qtransform.transform(model, {"version": 1, "quantize": [{**rule, "backward": "high_precision"}]})
    x = torch.randn(2, 24, conv.weight.shape[0])
    r = torch.randn(2, 24, conv.weight.shape[1])

    def site_grads(m):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        (m(xi) * r).sum().backward()
        return xi.grad, m.weight.grad, m.bias.grad

    high_grads = site_grads(high.transformer.h[0].mlp.c_fc)
    assert all(torch.equal(a, b) for a, b in zip(high_grads, site_grads(plain), strict=True))
    dx, dw, _ = site_grads(conv)
    w_lin = conv.weight.detach().t()
    g2, x2 = r.reshape(-1, w_lin.shape[0]), x.reshape(-1, w_lin.shape[1])
    want_dx = formats.fake_quantize(g2, "mxfp4") @ formats.fake_quantize(w_lin, "mxfp4", axis=0)
    xt, gt = formats.fake_quantize(x2, "mxfp4", axis=0), formats.fake_quantize(g2, "mxfp4", axis=0)
    assert torch.equal(dx, want_dx.reshape(x.shape))
    assert torch.equal(dw, xt.t() @ gt)


def test_fused_experts_are_refused_with_the_fix():
    from qtransform.models import build_tiny

    policy = {"version": 1, "quantize": [{"targets": ["Linear"], "format": "mxfp4", "backward": "high_precision"}]}
    with pytest.raises(UserError, match=r"experts.*Linear and Conv1D sites only.*ignore"):
        qtransform.transform(build_tiny("mixtral", hidden=32), policy)


def test_grad_wgrad_gives_g_its_own_role_in_wgrad():
    """torchao's wgrad_with_hp: G quantized in dgrad only (grad_wgrad null, input left out), so dW
    is the plain Linear's; or G in wgrad in another format than in dgrad."""
    model, x, r = _data()
    mx = ("mxfp8_e4m3", {"scale_rule": "rceil"})
    role = {"format": "mxfp8_e4m3", "scale_rule": "rceil"}
    hp = qtransform.transform(model, _policy("mxfp8_e4m3", backward="quantized", backward_roles={
        "grad": role, "weight": role, "grad_wgrad": None}))
    dx, dw, _ = _run(hp, x, r)
    want_dx, _ = _reference(x, model[0].weight.detach(), r, mx, mx)
    assert torch.equal(dx, want_dx)
    assert torch.equal(dw, _run(model, x, r)[1])  # Gᵀ·X in high precision, bit for bit
    own = qtransform.transform(model, _policy("nvfp4", backward="quantized", backward_roles={
        "grad": {"format": "nvfp4"}, "grad_wgrad": role, "input": role}))
    _, dw, _ = _run(own, x, r)
    g2, x2 = r.reshape(-1, OUT), x.reshape(-1, IN)
    want_dw = (formats.fake_quantize(g2, "mxfp8_e4m3", axis=0, scale_rule="rceil").t()
               @ formats.fake_quantize(x2, "mxfp8_e4m3", axis=0, scale_rule="rceil"))
    assert torch.equal(dw, want_dw)


TE_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]  # Transformer Engine's wgrad vector


def test_wgrad_hadamard_takes_a_fixed_sign_vector():
    model, x, r = _data()
    nv = ("nvfp4", {})
    t = qtransform.transform(model, _policy("nvfp4", backward="quantized",
                                            wgrad_hadamard={"block_size": 16, "signs": TE_SIGNS}))
    _, dw, _ = _run(t, x, r)
    _, want = _reference(x, model[0].weight.detach(), r, nv, nv, nv,
                         hadamard=(16, torch.tensor(TE_SIGNS, dtype=torch.float32)))
    assert torch.equal(dw, want)


@pytest.mark.parametrize(("hadamard", "path", "words"), [
    ({"signs": [1, -1]}, "signs", "16"),
    ({"signs": TE_SIGNS, "seed": 2}, "seed", "not both"),
    ({"kind": "hadamard", "signs": TE_SIGNS}, "signs", "random_hadamard"),
])
def test_bad_sign_vectors_name_their_path(hadamard, path, words):
    with pytest.raises(PolicyError) as err:
        load_policy(_policy("nvfp4", backward="quantized", wgrad_hadamard=hadamard))
    assert f"quantize[0].wgrad_hadamard.{path}:" in str(err.value) and words in str(err.value)
