"""Plans: every site of a model with what each pass does (or would do) there.

A plan is read from the same rows the pass manager records while it inserts, so `plan()` before a
transform and `Program.plan()` after it print the same table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qtransform.core.sites import Site

ROUTERS_SKIPPED = ("skipped: they stay in high precision, as every deployment stack keeps them; class "
                   "selectors such as Linear no longer reach them: add \"Router\" or their names to "
                   "the targets to include them")


@dataclass(frozen=True)
class PlanRow:
    """One insertion a pass makes (or would make): where, by which rule, with what settings."""

    site: str
    pass_name: str
    point: str
    rule: str
    detail: str


@dataclass
class Plan:
    """Every site with the rules that selected it (or none)."""

    sites: list[Site]
    rows: list[PlanRow]
    notes: list[str] = field(default_factory=list)  # each pass's lines about all its actions
    skipped: dict[str, list[str]] = field(default_factory=dict)  # routers -> sections passing them by

    def for_site(self, name: str) -> list[PlanRow]:
        return [r for r in self.rows if r.site == name]

    def to_dict(self) -> dict:
        return {
            "sites": [
                {**s.to_dict(), "actions": [r.__dict__ for r in self.for_site(s.name)],
                 **({"skipped_by": list(self.skipped[s.name])} if s.name in self.skipped else {})}
                for s in self.sites
            ],
            "notes": self.all_notes(),
        }

    def to_text(self) -> str:
        """A table: one line per site, its layer, role and what each pass does there."""
        width = max((len(s.name) for s in self.sites), default=4)
        lines = [f"{'site':<{width}}  {'kind':<6} {'layer':>5}  {'role':<7} actions"]
        for s in self.sites:
            acts = [f"{r.pass_name}:{r.point} {r.detail} [{r.rule}]" for r in self.for_site(s.name)]
            if s.name in self.skipped:
                acts.append(f"skipped: MoE router [{', '.join(self.skipped[s.name])}]")
            layer = "-" if s.layer is None else str(s.layer)
            lines.append(f"{s.name:<{width}}  {s.kind:<6} {layer:>5}  {s.role:<7} {'; '.join(acts) or '(none)'}")
        selected = sum(1 for s in self.sites if self.for_site(s.name))
        lines.append(f"{selected} of {len(self.sites)} sites selected, {len(self.rows)} insertions")
        return "\n".join(lines + self.all_notes())

    def all_notes(self) -> list[str]:
        """The passes' notes, then the line about skipped routers when there are any."""
        if not self.skipped:
            return list(self.notes)
        count = len(self.skipped)
        return [*self.notes, f"{count} MoE router{'s' * (count != 1)} {ROUTERS_SKIPPED}"]
