"""The configuration schema: one dataclass per section, each key with its default, its value range and a doc
(the reference tables and the plugins' flags are generated from these docs).

Defaults are mirrored in ``configs/scout.yaml``; loading and checking live in :mod:`scout_core.config`, which
re-exports every class here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Every section is re-exported by scout_core.config, the module the package imports them from.


def _range(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None) -> Any:
    """A field with a numeric range checked by :func:`scout_core.config.validate`."""
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
    persist_rounds: int = _range(0, ge=0, le=64)
    """A rank slower than the same round's other peers beyond their own spread in that round (1 + one robust
    sigma of theirs, and at least ``min_ratio``) in this many consecutive timing rounds of one kind of work is
    named a straggler even below the noise floor, when on average it was ``persist_ratio`` x their median (3
    names the paper's 1.3x straggler at its third slowed round). 0, the default: off, because on a shared host
    a healthy rank can also be slow for several rounds in a row (docs/consensus.md, "Persistently slower
    ranks")."""
    persist_ratio: float = _range(1.22, ge=1.0, le=1.35)
    """The least average (geometric mean, each round capped at 1.35x) ratio to the peers' median over
    ``persist_rounds`` rounds that names a persistently slower rank."""
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
    """host:port of a TCPStore that serves the observers (a launcher's or a cluster service's; it lets anyone
    who reaches it delete evidence); empty = a store daemon rank 0 starts that only the job can talk to (see
    docs/hangs.md)."""
    store_addr: str = ""
    """Address the store daemon listens on and advertises (one of rank 0's machine's); empty = loopback when
    every rank is on rank 0's machine, else MASTER_ADDR if it is rank 0's machine, else rank 0's address on the
    way to it (or its hostname without MASTER_ADDR)."""
    store_port: int = _range(0, ge=0, le=65535)
    """Port the store daemon listens on (under torchrun too: a firewall between machines must let it through);
    0 = a free port."""
    startup_timeout_s: float = _range(30.0, gt=0)
    """How long the observers may take to rendezvous."""
    start_method: str = "spawn"
    """``spawn``: each observer is a fresh interpreter (it imports no torch: about 0.15 s of CPU). ``fork``: a
    fork of its trainer (unsafe with InfiniBand memory registered on older kernels without ``RDMAV_FORK_SAFE``;
    its copy-on-write pages grow the trainer's memory). An ``on_incident`` callback without an import path (a
    lambda, a closure, a bound method, a function of the training script) cannot reach a fresh interpreter:
    then the observers are forked, with a warning."""
    layer_backward_marks: bool = False
    """Also publish when each repeated layer's backward finishes (a gradient hook per layer per step:
    locates a rank stopped inside backward, at 1-3 % of a CPU step; classification does not need it)."""
    ddp_bucket_hook: bool = False
    """Publish each DDP gradient bucket's all-reduce through a Python comm hook. Off (shipped), DDP's own
    bucket path runs untouched and each backward is published as one collective: a rank stopped inside backward
    is then not told apart from peers waiting in a bucket (a group verdict). On, that rank is named too, at the
    cost of any Python comm hook on gloo (several percent of a CPU step; docs/hangs.md)."""


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
    comm_timing_every: int = _range(2, ge=1)
    """Time the training-shaped scratch all-reduce (where no unshard's all-gather is timed for free: DDP,
    DeepSpeed ZeRO, tensor-parallel layers) on every this many hidden-layer checks once the communication
    history is learned (its first 10 measured rounds), and on every check while its readings run slow (where any
    peer group still learns or reads slow, every group times it: the ranks agree before each check). A group-wide
    communication slowdown is then confirmed at most one check later than with 1 (every check), two where a
    rotation over an even number of layers ends. Compute is timed on every check; HSDP's cross-group collectives
    too."""
    call_packages: list[str] = field(default_factory=list)
    """Top-level packages (besides torch and the packages of the checked layers' classes) whose types and
    functions a replayed call may name: where your model's argument dataclasses or mask functions live when that
    is not the layers' own package. A call naming anything else is not shipped (its check is skipped with a
    record); nothing a peer or a snapshot names outside these is ever looked up (docs/security.md)."""


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
    certify: str = "coverage"
    """When a capture becomes verified. ``coverage``: once, after it, replay has replayed clean every unit it
    samples (every repeated layer, embedding, output head, every parameter of the optimizer slice's rotation,
    every expert and catalog shape) on every rank. ``last_check_only`` (the paper's dense rule, faster): after
    one clean check; it does NOT promise that layers that check did not sample were clean."""
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
