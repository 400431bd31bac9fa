"""Typed configuration for the whole product.

Defaults live in the dataclasses below and are mirrored in
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
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = [
    "ActionsConfig",
    "CheckpointConfig",
    "ConfigError",
    "ConsensusConfig",
    "ControlConfig",
    "ObserverConfig",
    "PrometheusConfig",
    "ReplayCadence",
    "ReplayConfig",
    "ReportConfig",
    "SchemaKey",
    "ScoutConfig",
    "TopologyConfig",
    "load",
    "schema_keys",
    "to_yaml",
]


class ConfigError(ValueError):
    """A configuration key is unknown, mistyped or out of range."""


def _range(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None) -> Any:
    """A field with a numeric range checked by :func:`validate`."""
    return field(default=default, metadata={"ge": ge, "gt": gt, "le": le})


@dataclass(kw_only=True)
class ConsensusConfig:
    """Thresholds of statistical C3 and the confirmation of stragglers."""

    kappa: float = _range(4.0, gt=0)
    """Robust sigmas (MAD x 1.4826) a timing must exceed the median by."""
    min_ratio: float = _range(1.1, ge=1.0)
    """A flagged timing must also be at least this multiple of the median (the reference's slow filter is
    1.1x); with ``kappa`` 4 a rank 1.2x slower is confirmed within two rounds among 16 peers under the noise
    model of docs/consensus.md, and 10,000 healthy rounds of it confirm nobody."""
    min_delta_s: float = _range(0.001, ge=0)
    """... and exceed the median by at least this many seconds (compute is timed on the device's clock)."""
    comm_min_ratio: float = _range(1.5, ge=1.0)
    """The ratio floor for communication times (a group against its own history, HSDP groups against each
    other): a shared fabric is noisier than a device's own compute."""
    comm_min_delta_s: float = _range(0.005, ge=0)
    """The absolute floor for communication times (wall time: it includes the wait for the peers)."""
    mad_floor_fraction: float = _range(0.01, ge=0, le=1)
    """Floor of the robust scale as a fraction of the median (guards MAD = 0)."""
    confirm_rounds: int = _range(2, ge=1)
    """Consecutive flagged timing rounds before a straggler is reported."""
    noise_window_rounds: int = _range(64, ge=0, le=1024)
    """Compute timing rounds that set the noise floor: a flagged rank must also be slower, relative to the
    median, than 1 + 3 x the 99th-percentile excess of how far unflagged ranks strayed from their own usual
    in these rounds, and nothing is flagged in a work's first 3 rounds (a heavy-tailed device clock then
    raises the threshold in force instead of naming healthy ranks; docs/consensus.md). 0: the statistical
    rule alone. Also the length of a group's communication history for its temporal check (at least 10
    rounds; docs/replay.md)."""


@dataclass(kw_only=True)
class TopologyConfig:
    """How global ranks map to logical coordinates."""

    shape: dict[str, int] = field(default_factory=dict)
    """Parallel degrees by axis (``d s t p c e``), e.g. ``{d: 4, t: 2}``, for jobs that pass neither a
    DeviceMesh nor peer groups to ``enable()``; empty = pure data parallel (every rank a replica)."""
    order: list[str] = field(default_factory=lambda: ["d", "s", "t", "p", "c", "e"])
    """Placement order of the axes in ``shape``, slowest-varying first (row-major)."""


@dataclass(kw_only=True)
class ObserverConfig:
    """The out-of-band hang observer (paper section 7)."""

    enabled: bool = True
    """Start one observer process per rank."""
    silence_threshold_s: float = _range(5.0, gt=0)
    """Least seconds without visible progress before observers compare records. The threshold in force is
    the largest of this, ``adaptive_multiple`` x the longest healthy interval between progress marks seen
    after the warm-up, and ``io_silence_s`` in a data-loader or checkpoint phase."""
    adaptive_multiple: float = _range(4.0, ge=1)
    """The threshold is at least this multiple of the longest interval between two progress marks seen
    from step 1 on (a job with 10 s steps and no marks inside them waits 40 s)."""
    first_step_silence_s: float = _range(300.0, gt=0)
    """Silence tolerated during the warm-up (the first two steps of a started or resumed job: lazy
    initialization, compilation and communicator set-up); also the ceiling of the adaptive threshold."""
    io_silence_s: float = _range(300.0, gt=0)
    """Silence tolerated while a rank is in a data-loader fetch or checkpoint I/O (a long save on every
    rank is not a hang; a rank stuck there while its peers wait is named by its peers' observers)."""
    gather_timeout_s: float = _range(10.0, gt=0)
    """How long a group's leader waits for its members' evidence once an episode opens; members whose
    observers have not answered by then are named lost (live observers answer within a heartbeat)."""
    heartbeat_s: float = _range(1.0, gt=0)
    """How often a healthy observer checks the control store for an open episode (one message); raised
    to world_size / 20000 s on larger jobs so that the store serves at most 20k checks per second."""
    control_store: str = ""
    """host:port of a TCPStore that serves the observers (a launcher's or a cluster service's); empty = the
    torchrun agent's store under torchrun, else a store daemon rank 0 starts (see docs/hangs.md)."""
    store_addr: str = ""
    """Address the store daemon advertises (jobs without torchrun); empty = MASTER_ADDR, else rank 0's
    hostname."""
    store_port: int = _range(0, ge=0, le=65535)
    """Port the store daemon listens on; 0 = a free port."""
    startup_timeout_s: float = _range(30.0, gt=0)
    """How long the observers may take to rendezvous."""
    layer_backward_marks: bool = False
    """Also publish when each repeated layer's backward finishes (a gradient hook per layer per step:
    locates a rank stopped inside backward, at 1-3 % of a CPU step; classification does not need it)."""


@dataclass(kw_only=True)
class ReplayCadence:
    """Replay interval in optimizer steps per recipe; 0 disables a recipe."""

    embedding: int = _range(20, ge=0)
    """Embedding-layer recipe."""
    hidden: int = _range(20, ge=0)
    """Sampled repeated hidden layer recipe."""
    output: int = _range(20, ge=0)
    """Language-model output (head) recipe."""
    optimizer: int = _range(20, ge=0)
    """Optimizer-slice recipe."""
    expert: int = _range(20, ge=0)
    """MoE expert recipe (models enabled with ``moe=``): the next expert and catalog shape among the expert's
    replicas."""


@dataclass(kw_only=True)
class ReplayConfig:
    """In-situ replay (paper section 6)."""

    enabled: bool = True
    """Run replay checks at the optimizer boundary on due steps."""
    cadence: ReplayCadence = field(default_factory=ReplayCadence)
    """Per-recipe intervals."""
    input_variants: list[float] = field(default_factory=lambda: [0.1, 1.0, 10.0])
    """Scalings of floating inputs, each replayed as its own surface."""
    optimizer_slice_elems: int = _range(65536, ge=1)
    """Elements in the rotating optimizer slice."""
    deterministic: bool = True
    """Scope deterministic-algorithm mode to the replay."""
    moe_catalog: str = ""
    """Shape catalog from ``scout catalog build`` for the expert recipe; empty: replay each expert on the rows
    it received in training at the source (covers only the shapes training happens to route)."""
    determinism_every: int = _range(10, ge=0)
    """Vetting for bitwise determinism: on the first check of every layer and then on every this many
    hidden-layer checks, each rank replays the first variant twice and compares its own two runs; a rank
    whose runs differ is reported ``inconclusive`` (nondeterministic), never SDC, and from then on every
    check is vetted. The expert recipe does the same per recipe cycle (the first cycle, then every this many
    cycles). 0: never (trust ``deterministic``)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Certified recovery (paper section 8)."""

    enabled: bool = False
    """Capture in-memory snapshots at replay boundaries (needs ``replay.enabled`` and a replay cadence
    above 0: replay checks are where snapshots are taken and certified)."""
    directory: str = "checkpoints"
    """Durable store root (per-rank shards plus status sidecars) and the retrieval decisions
    (``decisions.jsonl``); a filesystem every rank of the job reaches. It belongs to one job: the in-memory
    snapshot folder is derived from it, and a start at another world size deletes the old size's slots."""
    memory_dir: str = ""
    """RAM-backed directory for in-memory snapshots and peer replicas; empty = ``/dev/shm`` (the temp
    dir where there is none). Too little space there falls back to ``<directory>/memory``, with a warning."""
    recipes_per_cycle: int = _range(1, ge=1)
    """K, the number of recipes in one certification cycle (1 for dense models)."""
    replicate_to_peer: bool = True
    """Copy each rank's snapshot to a partner on another machine."""
    keep_generations: int = _range(3, ge=2)
    """Durable generations kept on disk (verified and candidate need two)."""
    load_rejected: bool = False
    """Load a framework checkpoint that SCOUT labelled rejected when the restart names it (a DeepSpeed tag,
    Megatron's ``--ckpt-step``): for forensics. False: such a restart stops at once, naming the checkpoint and the
    newest verified one (a restart that names none loads what SCOUT chose)."""


@dataclass(kw_only=True)
class ActionsConfig:
    """What happens on a verdict: configured, not coded."""

    on_verdict: str = "log"
    """``log``: record and keep training. ``stop``: once the record and the retrieval decision are durable,
    every trainer exits with ``exit_code`` (on a hang the observer terminates its trainer) so the launcher
    restarts the job, which resumes from the certified checkpoint."""
    exit_code: int = _range(75, ge=1, le=255)
    """Exit status of trainers stopped by a verdict (75, EX_TEMPFAIL: restart)."""
    exclude_hosts_path: str = ""
    """JSON file of machines to exclude on restart (rewritten on each rank- or machine-scoped verdict);
    empty = ``exclude_hosts.json`` in ``checkpoint.directory`` when checkpoints are on, else beside
    ``report.jsonl_path``, else none."""


@dataclass(kw_only=True)
class ControlConfig:
    """Runtime control by the job's owner (``scout ctl RUN pause|resume|set KEY=VALUE``, docs/control.md)."""

    enabled: bool = True
    """Rank 0 keeps an owner-only control folder with a per-run secret, and commands are read at step
    boundaries."""
    directory: str = ""
    """Where runs' control folders are made (``<directory>/<run_id>``, mode 0700); empty =
    ``$XDG_RUNTIME_DIR/scout``, else ``~/.scout/runs``. ``scout ctl`` runs where it can read rank 0's folder."""
    every_steps: int = _range(10, ge=1)
    """Steps between two looks for commands: rank 0 reads the folder and one world broadcast of one number tells
    every rank, which then applies the commands at that same step."""


@dataclass(kw_only=True)
class PrometheusConfig:
    """Per-rank Prometheus metrics (needs ``prometheus-client``: ``pip install 'scout-core[prometheus]'``)."""

    port: int = _range(0, ge=0, le=65535)
    """Base TCP port of the metrics endpoint: each rank serves ``/metrics`` on ``port + LOCAL_RANK`` (ranks
    share a machine). 0: no endpoint."""
    address: str = "127.0.0.1"
    """Address the endpoint binds to: loopback by default (a scraper or node agent on the same machine);
    ``0.0.0.0`` exposes the job's state to the network."""
    textfile_dir: str = ""
    """A node exporter's textfile-collector directory: each rank rewrites ``scout_<job>_rank<R>.prom`` there
    (atomically, at most every ``textfile_interval_s``; ``<job>``: ``report.run_id``, else the Slurm / torchrun
    job id, so a restart rewrites the same files). Empty: none."""
    textfile_interval_s: float = _range(15.0, gt=0)
    """Least seconds between two rewrites of the textfile."""


@dataclass(kw_only=True)
class ReportConfig:
    """Where incident records and metrics go."""

    jsonl_path: str | None = None
    """JSON-lines incident file; ``None`` disables the file sink."""
    log_level: str = "WARNING"
    """Level of the logging sink (DEBUG, INFO, WARNING, ERROR)."""
    run_id: str = ""
    """Identifier stamped on every record; empty = generated at start."""
    fsync: bool = True
    """fsync the JSON-lines file after every record."""
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)


@dataclass(kw_only=True)
class ScoutConfig:
    """Everything SCOUT can be told."""

    consensus: ConsensusConfig = field(default_factory=ConsensusConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    observer: ObserverConfig = field(default_factory=ObserverConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    actions: ActionsConfig = field(default_factory=ActionsConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    control: ControlConfig = field(default_factory=ControlConfig)


_ACTIONS = ("log", "stop")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


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
    if cfg.report.log_level.upper() not in _LOG_LEVELS:
        raise ConfigError(f"report.log_level: {cfg.report.log_level!r}; allowed: {', '.join(_LOG_LEVELS)}")
    if not cfg.replay.input_variants or any(not (math.isfinite(v) and v > 0) for v in cfg.replay.input_variants):
        raise ConfigError(
            f"replay.input_variants: {cfg.replay.input_variants}; allowed: a non-empty list of positive scales")
    cadence = cfg.replay.cadence
    checks = cfg.replay.enabled and any(c > 0 for c in (cadence.embedding, cadence.hidden, cadence.output,
                                                         cadence.optimizer))
    if cfg.checkpoint.enabled and not checks:
        # Snapshots are taken and certified at replay checks: without any, nothing would ever be captured.
        raise ConfigError("checkpoint.enabled: certified snapshots are taken at replay checks; it needs "
                          "replay.enabled: true and at least one replay.cadence.* > 0")
    return cfg


def _error_message(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or "<root>"
    msg = str(exc).splitlines()[0]
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


def _field_docs() -> dict[tuple[str, str], str]:
    """Field docstrings (the string literal after each field) read from this module's source."""
    import ast
    import inspect
    import sys

    tree = ast.parse(inspect.getsource(sys.modules[__name__]))
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
    "axes with sizes >= 1; `actions.on_verdict` is `log` or `stop`; `report.log_level` is one of",
    "DEBUG, INFO, WARNING, ERROR, CRITICAL; `replay.input_variants` is a non-empty list of positive scales.",
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
