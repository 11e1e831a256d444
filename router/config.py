"""Router configuration: one frozen chain, built once by `cli.py` (or by tests) and never mutated.

Flag names and defaults follow sglang-router where the meaning is the same, so a user can move a
launch command over by changing only the program name. Each field a flag fills declares that flag
(baton/flags.py); `baton router`'s parser and docs/flags.md are generated from the declarations.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from baton.flags import FlagTable, declared_flags, flag, option


class WorkerRole(str, enum.Enum):
    """Which side of the router a worker serves. A URL registered on two sides is two workers."""

    REGULAR = "regular"  # colocated engine: prefill and decode in one process
    PREFILL = "prefill"
    DECODE = "decode"


class PolicyName(str, enum.Enum):
    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    POWER_OF_TWO = "power_of_two"
    CACHE_AWARE = "cache_aware"


class UpstreamClient(str, enum.Enum):
    LEAN = "lean"  # upstream/lean.py: the fast path
    AIOHTTP = "aiohttp"  # upstream/aiohttp_client.py: the obvious path, for comparison


@dataclass(frozen=True)
class WorkerSpec:
    """What it takes to register a worker: from flags, `POST /workers` or a Kubernetes pod."""

    url: str
    role: WorkerRole = WorkerRole.REGULAR
    bootstrap_port: int | None = None  # prefill only; None: the prefill uses its own default

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", normalize_url(self.url))
        assert self.bootstrap_port is None or self.role is WorkerRole.PREFILL, "bootstrap port on a non-prefill"
        assert self.bootstrap_port is None or 0 < self.bootstrap_port < 65536, self.bootstrap_port


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("empty worker URL")
    return url if "://" in url else f"http://{url}"


# The components that read the flags (Flag.owner), in the order `baton router --help` and docs/flags.md show them.
FLAG_OWNERS = {
    "workers": "the workers and their registry: colocated or PD, DP ranks (registry.py, cli.py)",
    "policy": "which worker a request goes to (policies/)",
    "server": "the listener: address, client key, request bodies, shutdown, logs (server.py, cli.py)",
    "admission": "how many requests run at once and how many wait (admission.py)",
    "dispatch": "the calls to the workers: deadline, retries, HTTP client, stalled workers (dispatch.py, upstream/)",
    "circuit_breaker": "each worker's circuit breaker (circuit_breaker.py, registry.py)",
    "health": "health probes (health.py)",
    "discovery": "Kubernetes service discovery (discovery/)",
    "fleet": "control routes sent to every worker: weight updates, pause and continue, memory, LoRA (fleet.py)",
}


@dataclass(frozen=True)
class RetryConfig:
    max_retries: int = flag(5, names=("--retry-max-retries",), help="attempts in all, the first included",
                            owner="dispatch")  # sglang-router's meaning
    initial_backoff_ms: float = flag(50.0, names=("--retry-initial-backoff-ms",),
                                     help="the wait before the second attempt", owner="dispatch")
    max_backoff_ms: float = flag(30_000.0, names=("--retry-max-backoff-ms",), help="the longest wait between attempts",
                                 owner="dispatch")
    backoff_multiplier: float = flag(1.5, names=("--retry-backoff-multiplier",),
                                     help="each wait is the one before times this", owner="dispatch")
    jitter_factor: float = flag(0.2, names=("--retry-jitter-factor",),
                                help="each wait varies at random by up to this fraction, so that many clients' "
                                     "retries do not arrive in step", owner="dispatch")

    def __post_init__(self) -> None:
        assert self.max_retries >= 1 and 0.0 <= self.jitter_factor <= 1.0 and self.backoff_multiplier >= 1.0


@dataclass(frozen=True)
class CircuitBreakerConfig:
    enabled: bool = flag(True, names=("--disable-circuit-breaker",), invert=True,
                         help="keep failing workers in rotation", owner="circuit_breaker")
    failure_threshold: int = flag(10, names=("--cb-failure-threshold",),
                                  help="consecutive failures that open a worker's breaker", owner="circuit_breaker")
    success_threshold: int = flag(3, names=("--cb-success-threshold",),
                                  help="successes in half-open that close it again", owner="circuit_breaker")
    timeout_secs: float = flag(60.0, names=("--cb-timeout-duration-secs",),
                               help="seconds a breaker stays open before a trial request (half-open)",
                               owner="circuit_breaker")

    def __post_init__(self) -> None:
        assert self.failure_threshold >= 1 and self.success_threshold >= 1 and self.timeout_secs >= 0


@dataclass(frozen=True)
class HealthCheckConfig:
    enabled: bool = flag(True, names=("--disable-health-check",), invert=True,
                         help="no health probes: a worker is routable once registered (with --dp-aware, once its "
                              "DP size is known)", owner="health", also=("workers",))
    failure_threshold: int = flag(3, names=("--health-failure-threshold",),
                                  help="failed probes in a row that take a worker out of rotation", owner="health")
    success_threshold: int = flag(2, names=("--health-success-threshold",),
                                  help="good probes in a row that bring it back", owner="health")
    timeout_secs: float = flag(5.0, names=("--health-check-timeout-secs",), help="seconds a probe may take",
                               owner="health", also=("server",))
    interval_secs: float = flag(60.0, names=("--health-check-interval-secs",),
                                help="seconds between the probes of a worker that has answered", owner="health")
    endpoint: str = flag("/health", names=("--health-check-endpoint",), help="the path probed", owner="health",
                         also=("dispatch",))
    startup_check_interval_secs: float = flag(
        1.0, names=("--worker-startup-check-interval",),
        help="seconds between the probes of a new worker until it first answers", owner="health", also=("dispatch",))

    def __post_init__(self) -> None:
        assert self.failure_threshold >= 1 and self.success_threshold >= 1
        assert self.interval_secs > 0 and self.timeout_secs > 0 and self.endpoint.startswith("/")


@dataclass(frozen=True)
class CacheAwareConfig:
    cache_threshold: float = flag(0.3, help="prefix-match rate above which the matched worker wins", owner="policy")
    # imbalance = max - min > abs AND max > min * rel
    balance_abs_threshold: int = flag(
        64, help="the load counts as imbalanced (the least loaded worker wins) where max - min exceeds this and "
                 "max exceeds min x --balance-rel-threshold", owner="policy")
    balance_rel_threshold: float = flag(1.5, help="see --balance-abs-threshold", owner="policy")
    max_tree_size: int = flag(2**26, help="characters per worker in the prefix tree", owner="policy")  # then LRU

    def __post_init__(self) -> None:
        assert 0.0 <= self.cache_threshold <= 1.0 and self.max_tree_size >= 1


def parse_selector(items: list[str]) -> dict[str, str]:
    """Label selector flags (KEY=VALUE, each item possibly comma-separated) -> {key: value}."""
    selector = {}
    for item in items:
        for part in item.split(","):
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"selector {part!r} is not KEY=VALUE")
            selector[key.strip()] = value.strip()
    return selector


def _selector(help: str, *names: str) -> dict[str, str]:
    return flag(default_factory=dict, cli_default=[], names=names, nargs="+", metavar="KEY=VALUE",
                parse=parse_selector, help=help, owner="discovery")


@dataclass(frozen=True)
class DiscoveryConfig:
    enabled: bool = flag(False, names=("--service-discovery",),
                         help="find the workers as Kubernetes pods, by label", owner="discovery", also=("server",))
    selector: dict[str, str] = _selector("the worker pods' labels (several, or comma-separated)", "--selector")
    prefill_selector: dict[str, str] = _selector("PD: the prefill pods' labels", "--prefill-selector")
    decode_selector: dict[str, str] = _selector("PD: the decode pods' labels", "--decode-selector")
    namespace: str | None = flag(None, names=("--service-discovery-namespace",),
                                 help="the namespace watched (default: all, which needs cluster-wide list and watch)",
                                 owner="discovery")
    port: int = flag(80, names=("--service-discovery-port",), help="the port the pods found serve on",
                     owner="discovery")
    resync_secs: float = flag(300.0, names=("--service-discovery-resync-secs",),
                              help="a full list at least this often, besides the watch", owner="discovery")
    api_server: str | None = flag(
        None, names=("--service-discovery-api-server",),
        help="API server URL (e.g. kubectl proxy); default: in-cluster config, else kubeconfig", owner="discovery")
    bootstrap_port_annotation: str = "sglang.ai/bootstrap-port"


@dataclass(frozen=True)
class RouterConfig:
    host: str = flag("0.0.0.0", help="address the router binds", owner="server")
    port: int = flag(30000, help="the router's port", owner="server")
    pd_disaggregation: bool = flag(False, help="PD: send each request to a prefill worker and a decode worker "
                                              "(--prefill, --decode)", owner="workers",
                                   also=("server", "dispatch", "discovery"))
    workers: tuple[WorkerSpec, ...] = ()  # from --worker-urls, --prefill and --decode (WORKER_FLAGS)
    policy: PolicyName = flag(PolicyName.CACHE_AWARE, help="how a worker is picked", owner="policy")
    prefill_policy: PolicyName | None = flag(None, help="PD: the prefill side's policy (default: --policy)",
                                             owner="policy")
    decode_policy: PolicyName | None = flag(None, help="PD: the decode side's policy (default: --policy)",
                                            owner="policy")
    dp_aware: bool = flag(False, help="route to (worker, DP rank); inject data_parallel_rank", owner="workers",
                          also=("health",))
    api_key: str | None = flag(  # never logged
        None, env="BATON_API_KEY", repr=False, owner="server",
        help="require 'Authorization: Bearer KEY' (default: $BATON_API_KEY, so the key stays out of argv)")
    engine_api_key: str | None = flag(  # never logged
        None, env="BATON_ENGINE_API_KEY", repr=False, owner="dispatch", also=("server",),
        help="send 'Authorization: Bearer KEY' on every call to the workers, instead of the client's "
             "header (the engines' --api-key; default: $BATON_ENGINE_API_KEY)")
    engine_admin_api_key: str | None = flag(  # never logged
        None, env="BATON_ENGINE_ADMIN_API_KEY", repr=False, owner="fleet",
        help="send 'Authorization: Bearer KEY' on the control routes the router sends to every worker (the "
             "engines' --admin-api-key; default: $BATON_ENGINE_ADMIN_API_KEY, else as on other calls)")
    weight_update_drain_secs: float = flag(
        60.0, owner="fleet",
        help="a weight update through the router: how long the requests in flight may run on (new ones wait) "
             "before the workers pause and end what is left (finish_reason abort)")
    request_timeout_secs: float = flag(1800.0, help="seconds a request may take, its retries included (then 504)",
                                       owner="dispatch", also=("fleet",))
    shutdown_timeout_secs: float = flag(  # aiohttp's default
        60.0, help="on SIGTERM: how long the requests in flight may run on once the listener closed", owner="server")
    max_payload_size: int = flag(512 * 1024 * 1024, help="the largest request body, in bytes (larger: 413)",
                                 owner="server")
    request_read_timeout_secs: float = flag(
        60.0, help="seconds a client has to send its first request head (else the connection is "
                   "closed) and a request's body (else 408); 0: no limit", owner="server")
    max_concurrent_requests: int = flag(-1, help="-1: unlimited", owner="admission")  # -1: no queue either
    queue_size: int = flag(100, help="requests that wait for a slot beyond --max-concurrent-requests (more: 429)",
                           owner="admission")
    queue_timeout_secs: float = flag(60.0, help="seconds a request may wait for a slot (then 408)", owner="admission")
    retry: RetryConfig = field(default_factory=RetryConfig)
    circuit_breaker: CircuitBreakerConfig = field(default_factory=CircuitBreakerConfig)
    health: HealthCheckConfig = field(default_factory=HealthCheckConfig)
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    abort_timeout_secs: float = 5.0
    worker_stall_timeout_secs: float = flag(
        15.0, names=("--worker-stall-timeout",), owner="dispatch",
        help="seconds a worker holding requests may leave health probes unanswered before its "
             "requests are ended (and retried where nothing was sent yet); 0: off")
    upstream_client: UpstreamClient = flag(UpstreamClient.LEAN, owner="dispatch",
                                           help="HTTP client to workers: lean (fast) or aiohttp (reference)")
    log_level: str = flag("info", choices=["debug", "info", "warn", "warning", "error"], help="the router's log level",
                          owner="server")

    def __post_init__(self) -> None:
        roles = {w.role for w in self.workers}
        if self.pd_disaggregation:
            assert WorkerRole.REGULAR not in roles, "--worker-urls cannot be mixed with --pd-disaggregation"
        else:
            assert roles <= {WorkerRole.REGULAR}, "--prefill/--decode need --pd-disaggregation"
        assert self.request_timeout_secs > 0 and self.max_payload_size > 0 and self.queue_size >= 0
        assert self.shutdown_timeout_secs >= 0, "--shutdown-timeout-secs must be >= 0"
        assert self.worker_stall_timeout_secs >= 0
        assert self.request_read_timeout_secs >= 0, "--request-read-timeout-secs must be >= 0"
        assert self.weight_update_drain_secs >= 0, "--weight-update-drain-secs must be >= 0"

    def policy_for(self, role: WorkerRole) -> PolicyName:
        if role is WorkerRole.PREFILL and self.prefill_policy is not None:
            return self.prefill_policy
        if role is WorkerRole.DECODE and self.decode_policy is not None:
            return self.decode_policy
        return self.policy

    @property
    def roles(self) -> tuple[WorkerRole, ...]:
        return (WorkerRole.PREFILL, WorkerRole.DECODE) if self.pd_disaggregation else (WorkerRole.REGULAR,)


# The flags that fill no single field: cli.config_from_args turns them into `workers` and `retry`.
WORKER_FLAGS = (
    option("--worker-urls", default=[], nargs="*", help="colocated engines", owner="workers"),
    option("--prefill", default=[], nargs="+", action="append", metavar="URL [BOOTSTRAP_PORT]", owner="workers",
           help="prefill engine, optionally with its bootstrap port (a number or 'none'); repeatable"),
    option("--decode", default=[], action="append", metavar="URL", help="decode engine; repeatable", owner="workers"),
)
DISABLE_RETRIES = option("--disable-retries", default=False, help="one attempt per request (--retry-max-retries 1)",
                         owner="dispatch")


def flag_table() -> FlagTable:
    """Every flag of `baton router`."""
    return FlagTable(FLAG_OWNERS, (*WORKER_FLAGS, *declared_flags(RouterConfig), DISABLE_RETRIES)).check()
