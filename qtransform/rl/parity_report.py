"""The parity report: its data (per-token gaps, verl's metrics, the floor, attribution, the run's
metadata) and how it is written (parity.json, parity.md, parity.png). `rl/parity.py` computes it."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qtransform.core.io import encode_floats, read_input_text, write_json, write_text
from qtransform.core.result import decode_numbers, json_file
from qtransform.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ATTRIBUTION_KEY = "k3_kl"  # sites are ranked by what they add to the floor's k3_kl
SUMMARY_KEYS = ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_abs_diff", "ppl_ratio", "ess",
                "ratio_p05", "ratio_p95")
MEANING = {  # one line per metric for parity.md (docs/rl.md says more)
    "kl": "KL(rollout‖trainer), k1: mean of lp_rollout - lp_trainer per token",
    "k3_kl": "KL, k3: mean of exp(r) - r - 1 per token, r = lp_trainer - lp_rollout (>= 0)",
    "training_ppl": "trainer perplexity of the completions (mean over sequences)",
    "rollout_ppl": "rollout perplexity of the completions",
    "log_ppl_diff": "rollout minus trainer mean log-prob per sequence, averaged",
    "log_ppl_abs_diff": "the same, absolute",
    "ppl_ratio": "mean of exp(log_ppl_diff): training_ppl / rollout_ppl per sequence",
    "chi2_token": "χ² divergence per token: mean of exp(r)² - 1",
    "chi2_seq": "χ² per sequence: mean of exp(2 Σ r) - 1",
    "ess": "effective sample size of the sequence importance weights, fraction of the batch",
    "ratio_p05": "5th percentile of the token importance ratios exp(r)",
    "ratio_p50": "median token importance ratio",
    "ratio_p95": "95th percentile of the token importance ratios",
}


@dataclass
class ParityReport:
    """Per-token gaps between trainer and engine log-probs, summarized (all floats are float64).

    `metrics`, `floor` and `gap` use verl's rollout_corr names (`rl/mismatch.py`); `floor` is the
    original model against the same engine, `gap` = metrics - floor; `attribution` ranks sites
    (one on at a time) by what each adds to the floor's k3_kl; `meta` records the run."""

    phase: str
    tokens: int
    mean_abs_delta: float
    max_abs_delta: float
    k1: list[float]  # per sequence
    k3: list[float]
    greedy_agreement: float | None  # fraction of positions where the greedy tokens agree
    first_divergence: list[int | None] | None  # per prompt: first position that differs
    largest: list[dict[str, Any]]  # the tokens where |Δ| is largest
    metrics: dict[str, float] = field(default_factory=dict)
    outside_support: int = 0  # sampled tokens the trainer's processed distribution excludes
    floor: dict[str, float] | None = None
    gap: dict[str, float] | None = None
    attribution: list[dict[str, Any]] | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    deltas: list[list[float]] = field(default_factory=list, repr=False)  # lp_e - lp_t per token

    @classmethod
    def build(cls, *, phase: str, trainer: list[list[float]], engine: list[list[float]],
              prompts: list[list[int]], completions: list[list[int]], metrics: dict[str, float],
              outside_support: int, floor: dict[str, float] | None,
              attribution: list[dict[str, Any]] | None, greedy_agreement: float | None,
              first_divergence: list[int | None] | None, top: int, tokenizer: PreTrainedTokenizerBase | None,
              meta: dict[str, Any]) -> ParityReport:
        deltas = [[e - t if math.isfinite(e - t) else math.inf for e, t in zip(es, ts, strict=True)]
                  for es, ts in zip(engine, trainer, strict=True)]
        gaps = [abs(d) for seq in deltas for d in seq if math.isfinite(d)]
        text = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else (lambda ids: None)
        rows = [{"sequence": s, "position": i, "token": tok, "text": text([tok]), "trainer": t,
                 "engine": e, "delta": d}
                for s, (completion, ts, es, ds) in enumerate(zip(completions, trainer, engine, deltas,
                                                                 strict=True))
                for i, (tok, t, e, d) in enumerate(zip(completion, ts, es, ds, strict=True))
                if math.isfinite(d)]
        return cls(
            phase=phase, tokens=len(gaps), mean_abs_delta=math.fsum(gaps) / len(gaps) if gaps else 0.0,
            max_abs_delta=max(gaps, default=0.0),
            k1=[math.fsum(d for d in seq if math.isfinite(d)) for seq in deltas],
            k3=[math.fsum(math.expm1(-d) + d for d in seq if math.isfinite(d)) for seq in deltas],
            greedy_agreement=greedy_agreement, first_divergence=first_divergence,
            largest=sorted(rows, key=lambda r: -abs(r["delta"]))[:top], metrics=metrics,
            outside_support=outside_support, floor=floor,
            gap=None if floor is None else {k: metrics[k] - floor[k] for k in metrics},
            attribution=attribution,
            samples=[{"prompt": p, "completion": c, "prompt_text": text(p), "completion_text": text(c)}
                     for p, c in zip(prompts, completions, strict=True)],
            meta=meta, deltas=deltas)

    @property
    def mean_k1(self) -> float:
        return sum(self.k1) / len(self.k1)

    @property
    def mean_k3(self) -> float:
        return sum(self.k3) / len(self.k3)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(mean_k1=self.mean_k1, mean_k3=self.mean_k3)
        return out

    def summary(self, keys: tuple[str, ...] = SUMMARY_KEYS) -> list[str]:
        """Text lines: each metric with its floor and gap; the top sites when attributed."""
        head = f"{'metric':<18}{'value':>12}" + (f"{'floor':>12}{'gap':>12}" if self.floor else "")
        lines = [head]
        for key in keys:
            line = f"{key:<18}{self.metrics[key]:>12.4g}"
            if self.floor is not None and self.gap is not None:
                line += f"{self.floor[key]:>12.4g}{self.gap[key]:>+12.3g}"
            lines.append(line)
        if self.outside_support:
            lines.append(f"{self.outside_support} sampled tokens outside the trainer's processed "
                         "distribution (importance ratio 0), left out of the metrics")
        if self.attribution:
            lines.append(f"sites by {ATTRIBUTION_KEY} added alone (one site on, the rest off):")
            lines += [f"  {r['rank']:>3}. {r['site']}  {r['added']:+.3e}" for r in self.attribution[:5]]
        return lines

    def markdown(self) -> str:
        agree = ("n/a (the engine has no greedy decoding)" if self.greedy_agreement is None
                 else f"{self.greedy_agreement:.4f}")
        m = self.meta
        sampler = ", ".join(f"{k} {v}" for k, v in m.get("sampler", {}).items())
        lines = [
            "# Rollout/trainer parity", "",
            f"- model: `{m.get('model')}`; engine: {m.get('engine')}; policy: "
            f"{m.get('policy_path') or 'n/a'}{' (sha256 ' + m['policy_sha256'][:12] + ')' if m.get('policy_sha256') else ''}",
            f"- sampler: {sampler}; controller step {m.get('controller_step')}; seed {m.get('seed')}",
            f"- trainer log-probs scored in the `{self.phase}` phase; {self.tokens} completion tokens "
            f"in {len(self.k1)} sequences; qtransform {m.get('qtransform_version')}, {m.get('date')}",
            "",
            "## Mismatch (verl's rollout_corr metrics)", "",
        ]
        if self.floor is not None and self.gap is not None:
            lines += ["| metric | value | floor (original model) | gap (value - floor) | meaning |",
                      "|---|---|---|---|---|"]
            lines += [f"| {k} | {v:.4g} | {self.floor[k]:.4g} | {self.gap[k]:+.3g} | {MEANING.get(k, '')} |"
                      for k, v in self.metrics.items()]
        else:
            lines += ["| metric | value | meaning |", "|---|---|---|"]
            lines += [f"| {k} | {v:.4g} | {MEANING.get(k, '')} |" for k, v in self.metrics.items()]
        lines += ["", f"Sampled tokens outside the trainer's processed distribution: "
                      f"{self.outside_support} (left out of the metrics).", "",
                  "| per token | value |", "|---|---|",
                  f"| mean abs Δ log-prob | {self.mean_abs_delta:.3e} |",
                  f"| max abs Δ log-prob | {self.max_abs_delta:.3e} |",
                  f"| mean k1 per sequence (KL engine‖trainer) | {self.mean_k1:.3e} |",
                  f"| mean k3 per sequence | {self.mean_k3:.3e} |",
                  f"| greedy token agreement | {agree} |", ""]
        if self.attribution:
            lines += ["## Attribution: one site on at a time", "",
                      f"Each site alone transformed (every other site off), scored against the same "
                      f"engine; `added` is its {ATTRIBUTION_KEY} minus the floor's.", "",
                      "| rank | site | modules | points | added k3_kl | kl | chi2_token | log_ppl_abs_diff |",
                      "|---|---|---|---|---|---|---|---|"]
            lines += [f"| {r['rank']} | {r['site']} | {', '.join(r['modules'])} | "
                      f"{', '.join(r.get('points', []))} | {r['added']:+.3e} | "
                      f"{r['kl']:.3e} | {r['chi2_token']:.3e} | {r['log_ppl_abs_diff']:.3e} |"
                      for r in self.attribution]
            lines.append("")
        lines += ["## Samples", "", "| sequence | prompt | completion |", "|---|---|---|"]
        lines += [f"| {i} | {_cell(s['prompt_text'], s['prompt'])} | {_cell(s['completion_text'], s['completion'])} |"
                  for i, s in enumerate(self.samples)]
        lines += ["", "## Largest gaps", "",
                  "| sequence | position | token | trainer | engine | Δ |", "|---|---|---|---|---|---|"]
        lines += [f"| {t['sequence']} | {t['position']} | {_cell(t['text'], [t['token']])} | "
                  f"{t['trainer']:.6f} | {t['engine']:.6f} | {t['delta']:+.3e} |" for t in self.largest]
        return "\n".join(lines) + "\n"

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ParityReport:
        """Read parity.json (or the folder `save` wrote)."""
        p = json_file(path, "parity.json")
        text = read_input_text(p, "parity report (give parity.json or its folder)")
        try:
            data = json.loads(text)
            known = {f.name for f in fields(cls)}
            values = {k: v if k in _TEXT_FIELDS else decode_numbers(v) for k, v in data.items() if k in known}
            values["largest"] = [{**t, "text": raw["text"]} for t, raw in zip(values["largest"], data["largest"],
                                                                                   strict=True)]
            return cls(**values)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{p}: not a parity report this qtransform version can read "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                            "re-run `qtransform parity`") from None

    def save(self, folder: str | os.PathLike[str]) -> dict[str, Path]:
        """parity.json, parity.md and parity.png (histogram of |Δ|) in `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = {"json": write_json(folder / "parity.json", encode_floats(self.to_dict())),
                 "markdown": write_text(folder / "parity.md", self.markdown()),
                 "png": folder / "parity.png"}
        self._histogram(paths["png"])
        return paths

    def _histogram(self, path: Path) -> None:
        import matplotlib  # loaded only when a figure is drawn (0.5 s)

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt

        gaps = [abs(d) for seq in self.deltas for d in seq if math.isfinite(d)]
        floor = 1e-12
        logs = [math.log10(max(g, floor)) for g in gaps]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.hist(logs, bins=40, color="#4c72b0")
        ax.set_xlabel("log10 |Δ log-prob| (trainer vs engine; exact zeros at -12)")
        ax.set_ylabel("tokens")
        ax.set_title(f"parity: mean |Δ| {self.mean_abs_delta:.2e}, max {self.max_abs_delta:.2e}")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


_TEXT_FIELDS = ("phase", "samples", "meta")  # free text: never decoded as numbers


def _cell(text: str | None, ids: list[int]) -> str:
    """A Markdown table cell: the text (code-quoted, pipes and newlines escaped), else the ids."""
    if text is None:
        return " ".join(str(i) for i in ids)
    return "`" + text.replace("`", "'").replace("|", "\\|").replace("\n", "⏎") + "`"
