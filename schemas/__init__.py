"""The policy schema: Pydantic models, the selector language, loading and readable errors."""

from qtransform.core.sites import closest_names

from .errors import PolicyError, Problem
from .legacy import from_legacy_srdd
from .loading import PolicyLike, dump_policy, is_legacy_srdd, load_policy
from .policy import Policy
from .sections.hw_error import HWErrorSpec
from .sections.instrument import InstrumentSpec, Thresholds
from .sections.noise import Multiplier, NoiseSpec, Schedule
from .sections.quantize import QuantRule
from .selectors import Selector, SiteRef, parse_layers, resolve_quant_rules

__all__ = [
    "HWErrorSpec",
    "InstrumentSpec",
    "Multiplier",
    "NoiseSpec",
    "Policy",
    "PolicyError",
    "PolicyLike",
    "Problem",
    "QuantRule",
    "Schedule",
    "Selector",
    "SiteRef",
    "Thresholds",
    "closest_names",
    "dump_policy",
    "from_legacy_srdd",
    "is_legacy_srdd",
    "load_policy",
    "parse_layers",
    "resolve_quant_rules",
]
