"""Loading and checking SCOUT's configuration (schema defaults, a YAML file, overrides), and the reference
generated from its schema.

The schema's dataclasses live in :mod:`scout_core.config_schema` (re-exported here) and are mirrored in
``configs/scout.yaml``. :func:`load` merges, in order: the schema defaults, a
YAML file, then dotlist overrides such as ``replay.cadence.hidden=50``.
OmegaConf checks key names and types against the schema; this module adds the
value ranges. Every failure raises :class:`ConfigError` naming the key and what
is allowed, because a silently ignored typo in a diagnosis config is a missed
incident.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

# Re-exported: the schema's sections are imported from here across the package, the plugins and the tests.
from scout_core import config_schema
from scout_core.config_schema import (
    ActionsConfig,
    CheckpointConfig,
    ConsensusConfig,
    ControlConfig,
    ObserverConfig,
    PrometheusConfig,
    ReplayCadence,
    ReplayConfig,
    ReportConfig,
    ScoutConfig,
    TopologyConfig,
)

__all__ = [
    "ActionsConfig",
    "CheckpointConfig",
    "ConsensusConfig",
    "ControlConfig",
    "ObserverConfig",
    "PrometheusConfig",
    "ReplayCadence",
    "ReplayConfig",
    "ReportConfig",
    "ScoutConfig",
    "TopologyConfig",
    "CERTIFY_MODES",
    "ConfigError",
    "SchemaKey",
    "load",
    "schema_keys",
    "to_yaml",
]


class ConfigError(ValueError):
    """A configuration key is unknown, mistyped or out of range."""


_ACTIONS = ("log", "stop")
_START_METHODS = ("spawn", "fork")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
CERTIFY_MODES = ("coverage", "last_check_only")
"""``checkpoint.certify``: see :mod:`scout_core.checkpoint.coverage`."""


def _check_ranges(obj: Any, prefix: str = "") -> None:
    for f in dataclasses.fields(obj):
        key = f"{prefix}{f.name}"
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_ranges(value, key + ".")
            continue
        ge, gt, le = (f.metadata.get(k) for k in ("ge", "gt", "le"))
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{key}: must be a finite number, got {value}")
            allowed = " and ".join(
                s for s in (f">= {ge}" if ge is not None else "", f"> {gt}" if gt is not None else "",
                            f"<= {le}" if le is not None else "") if s
            )
            if (ge is not None and value < ge) or (gt is not None and value <= gt) or (le is not None and value > le):
                raise ConfigError(f"{key}: {value} is out of range; allowed: {allowed}")


def validate(cfg: ScoutConfig) -> ScoutConfig:
    """Check ranges and cross-field rules; return ``cfg`` unchanged."""
    _check_ranges(cfg)
    order = list(cfg.topology.order)
    if sorted(order) != sorted("dstpce"):
        raise ConfigError(f"topology.order: {order} must be a permutation of [d, s, t, p, c, e]")
    unknown = sorted(set(cfg.topology.shape) - set("dstpce"))
    if unknown or any(v < 1 for v in cfg.topology.shape.values()):
        raise ConfigError(f"topology.shape: {dict(cfg.topology.shape)}; allowed: axes d s t p c e with sizes >= 1")
    if cfg.actions.on_verdict not in _ACTIONS:
        raise ConfigError(f"actions.on_verdict: {cfg.actions.on_verdict!r}; allowed: {', '.join(_ACTIONS)}")
    if cfg.observer.start_method not in _START_METHODS:
        raise ConfigError(f"observer.start_method: {cfg.observer.start_method!r}; allowed: "
                          f"{', '.join(_START_METHODS)}")
    if cfg.checkpoint.certify not in CERTIFY_MODES:
        raise ConfigError(f"checkpoint.certify: {cfg.checkpoint.certify!r}; allowed: {', '.join(CERTIFY_MODES)}")
    if cfg.report.log_level.upper() not in _LOG_LEVELS:
        raise ConfigError(f"report.log_level: {cfg.report.log_level!r}; allowed: {', '.join(_LOG_LEVELS)}")
    if not cfg.replay.input_variants or any(not (math.isfinite(v) and v > 0) for v in cfg.replay.input_variants):
        raise ConfigError(
            f"replay.input_variants: {cfg.replay.input_variants}; allowed: a non-empty list of positive scales")
    cadence = cfg.replay.cadence
    checks = cfg.replay.enabled and any(c > 0 for c in (cadence.embedding, cadence.hidden, cadence.output,
                                                         cadence.optimizer, cadence.expert))
    if cfg.checkpoint.enabled and not checks:
        # Snapshots are taken and certified at replay checks: without any, nothing would ever be captured.
        raise ConfigError("checkpoint.enabled: certified snapshots are taken at replay checks; it needs "
                          "replay.enabled: true and at least one replay.cadence.* > 0")
    return cfg


_REMOVED = {
    "checkpoint.recipes_per_cycle": "was removed: a capture is verified once replay has covered every unit it "
                                    "samples (checkpoint.certify: coverage, the default); checkpoint.certify: "
                                    "last_check_only is the old K = 1 rule",
}
"""Keys an older configuration may still carry, and what replaced them."""


def _error_message(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or "<root>"
    msg = str(exc).splitlines()[0]
    if key in _REMOVED:
        msg = _REMOVED[key]
    return f"{key}: {msg}"


def load(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = (),
         values: Mapping[str, Any] | None = None) -> ScoutConfig:
    """Build a :class:`ScoutConfig` from defaults, an optional YAML file, dotlist overrides and ``values``
    (dotted key to an already-typed value, as a plugin's flags parse them; applied last)."""
    schema = OmegaConf.structured(ScoutConfig)
    layers = []
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {os.fspath(path)!r} does not exist")
        try:
            layers.append(OmegaConf.load(path))
        except Exception as exc:  # YAML syntax errors surface here
            raise ConfigError(f"config file {os.fspath(path)!r} is not valid YAML: {exc}") from exc
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
    try:
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        if values:
            typed = OmegaConf.create()
            for key, value in values.items():
                OmegaConf.update(typed, key, value, force_add=True)
            layers.append(typed)
        merged = OmegaConf.merge(schema, *layers)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(_error_message(exc)) from exc
    assert isinstance(cfg, ScoutConfig)
    return validate(cfg)


def resolve(config: ScoutConfig | str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> ScoutConfig:
    """SCOUT's configuration from what a user hands a plugin's callback: a :class:`ScoutConfig`, a YAML file's path,
    or None (the shipped defaults), with dotted ``key=value`` overrides on top."""
    if isinstance(config, ScoutConfig):
        if not overrides:
            return validate(config)
        try:
            merged = OmegaConf.merge(OmegaConf.structured(config), OmegaConf.from_dotlist(list(overrides)))
            cfg = OmegaConf.to_object(merged)
        except OmegaConfBaseException as exc:
            raise ConfigError(_error_message(exc)) from exc
        assert isinstance(cfg, ScoutConfig)
        return validate(cfg)
    if config is not None and not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"config is a ScoutConfig, a YAML file's path or None; got {type(config).__name__}")
    return load(config, overrides)


def _field_docs() -> dict[tuple[str, str], str]:
    """Field docstrings (the string literal after each field) read from the schema's source."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(config_schema))
    docs: dict[tuple[str, str], str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            for stmt, nxt in zip(body, body[1:]):
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                    docs[(node.name, stmt.target.id)] = " ".join(str(nxt.value.value).split())
    return docs


@dataclass(frozen=True)
class SchemaKey:
    """One leaf key of the schema, as a plugin turns it into a flag of its framework."""

    key: str
    """Dotted key (``replay.cadence.hidden``)."""
    type: Any
    """The field's annotation, as the dataclass declares it (a string under postponed annotations)."""
    default: Any
    doc: str
    allowed: str
    """The range or choices, in words (``>= 1``, ``true / false``)."""


def schema_keys() -> list[SchemaKey]:
    """Every leaf key of :class:`ScoutConfig` in schema order, with its default, range and field doc: the one
    walk of the schema that the reference tables and the plugins' flags are generated from."""
    docs = _field_docs()

    def walk(klass: type, prefix: str) -> list[SchemaKey]:
        out = []
        for f in dataclasses.fields(klass):
            factory = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if factory is not None and dataclasses.is_dataclass(factory):
                out += walk(factory, f"{prefix}{f.name}.")  # type: ignore[arg-type]
                continue
            default = f.default if f.default is not dataclasses.MISSING else factory()  # type: ignore[misc]
            m = f.metadata
            allowed = " and ".join(
                s for s in (f">= {m['ge']}" if m.get("ge") is not None else "",
                            f"> {m['gt']}" if m.get("gt") is not None else "",
                            f"<= {m['le']}" if m.get("le") is not None else "") if s
            ) or {"bool": "true / false"}.get(str(f.type), str(f.type).replace(" | ", " or "))  # a table cell
            out.append(SchemaKey(key=prefix + f.name, type=f.type, default=default,
                                 doc=docs.get((klass.__name__, f.name), ""), allowed=allowed))
        return out

    return walk(ScoutConfig, "")


def reference_tables(key: Callable[[str], str] = lambda k: k) -> list[str]:
    """One markdown table per section of the schema (key, default, allowed, meaning), each key shown as
    ``key(dotted)``: a plugin shows its flags (``--scout.replay.cadence.hidden``) from the same schema."""
    lines: list[str] = []
    keys = schema_keys()
    for section in dataclasses.fields(ScoutConfig):
        lines += [f"## `{section.name}`", "", "| key | default | allowed | meaning |", "|---|---|---|---|"]
        lines += [f"| `{key(k.key)}` | `{k.default}` | {k.allowed} | {k.doc} |" for k in keys
                  if k.key.split(".", 1)[0] == section.name]
        lines.append("")
    return lines


CROSS_FIELD_RULES = [
    "Cross-field rules: `topology.order` is a permutation of `d s t p c e` and `topology.shape` uses those",
    "axes with sizes >= 1; `actions.on_verdict` is `log` or `stop`; `observer.start_method` is `spawn` or `fork`;",
    "`checkpoint.certify` is `coverage` or",
    "`last_check_only`; `report.log_level` is one of DEBUG, INFO, WARNING, ERROR, CRITICAL;",
    "`replay.input_variants` is a non-empty list of positive scales.",
]


def markdown_reference() -> str:
    """The configuration reference (docs/configuration.md), generated from the schema."""
    lines = [
        "# Configuration",
        "",
        "<!-- generated by scout_core.config.markdown_reference(); a test keeps it current -->",
        "",
        "`scout_core.config.load(path=None, overrides=())` merges the schema defaults, a YAML file and dotlist",
        "overrides (`replay.cadence.hidden=50`). Unknown keys, wrong types and out-of-range values raise",
        "`ConfigError` naming the key and what is allowed. Defaults are in `configs/scout.yaml`.",
        "",
    ]
    return "\n".join(lines + reference_tables() + CROSS_FIELD_RULES) + "\n"


def to_yaml(cfg: ScoutConfig) -> str:
    """Render a config (for example the defaults) as YAML."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
