"""``kvtiers serve`` and ``kvtiers status``: the service's start-up, signals and report.

The service's configuration is a stack file: its first tier must be ``kind: cpu``, whose
``capacity`` sizes the pool and ``shared_memory_name`` names it (``kvtiers-serve`` when
unset). The slot size is the stack's ``model:`` section's chunk rounded to 4 KiB, or
``--slot-bytes``. Tiers below the pool (file, s3, fsspec; ``write: through`` or
``back``) are the service's own: built per namespace, under it
(:mod:`kvtiers.service.lower`). A ``tenants:`` section names the tenants whose engines
share the pool and caps them in the pool (quotas and protected shares) and below it
(quotas): :func:`check_service_tenants`. A ``retention:`` section has the pool honour the
retention hints engines send and, with ``admin_token_env``, serves the admin endpoint on
the exporter's port (``--metrics-port``): :mod:`kvtiers.service.retention`.
"""

from __future__ import annotations

import grp
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from kvtiers.config import CPUTierConfig, StackConfig, load_stack_config
from kvtiers.config.paths import item_path, key_path
from kvtiers.config.tenants import TENANTS_PATH
from kvtiers.errors import ConfigError

SHM_DIR = Path("/dev/shm")
DEFAULT_POOL = "kvtiers-serve"


def default_socket() -> Path:
    """``$XDG_RUNTIME_DIR/kvtiers/serve.sock``, else ``/tmp/kvtiers-<uid>/serve.sock``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "kvtiers" if runtime else Path(f"/tmp/kvtiers-{os.geteuid()}")
    return base / "serve.sock"


def _socket_dir(path: Path, group: int | None) -> None:
    """Make the socket's directory (0700, 0750 with a group) if missing; refuse one that
    another user owns."""
    directory = path.parent
    directory.mkdir(mode=0o750 if group is not None else 0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.geteuid():
        raise ConfigError(f"{directory} is owned by uid {info.st_uid}; choose another "
                          "--socket", path="socket")


def check_service_tenants(config: StackConfig) -> None:
    """Refuse a protected share on a tier below the pool: the service protects tenants'
    shares in its pool only (a quota below it is kept in each namespace's instance of
    that tier, by evicting the tenant's own chunks there). The error's path is
    ``tenants.members[i].protected.<tier>``."""
    if config.tenants is None:
        return
    pool = config.tiers[0].name
    for idx, tenant in enumerate(config.tenants.members):
        for tier in tenant.protected:
            if tier != pool:
                where = item_path(key_path(TENANTS_PATH, "members"), idx)
                raise ConfigError(
                    f"kvtiers serve protects tenants' shares in its pool (tier {pool!r}) "
                    f"only: a protected share on tier {tier!r} would not be enforced; "
                    f"remove it or move it to {pool!r}",
                    path=key_path(key_path(where, "protected"), tier),
                )


def admin_token(config: StackConfig, metrics_port: int | None) -> str | None:
    """The admin endpoint's token when ``retention.admin_token_env`` names its variable
    (the stack's rule: set and non-empty); the endpoint is on the exporter, so the
    service then needs ``--metrics-port``."""
    from kvtiers.stack.builder import _admin_token

    token = _admin_token(config)
    if token is not None and metrics_port is None:
        raise ConfigError("the admin endpoint is served on the service's exporter: give "
                          "--metrics-port", path="retention.admin_token_env",
                          source=config.source)
    return token


def _located(error: ConfigError, config_path: str) -> ConfigError:
    """``error`` with its source as ``<file>:<line>`` (the line of its path)."""
    from kvtiers.config.yamlfile import read_yaml

    line = read_yaml(config_path).line_of(error.path)
    where = f"{config_path}:{line}" if line is not None else config_path
    return ConfigError(error.message, path=error.path, source=where)


def pool_settings(config_path: str, slot_bytes: int | None) -> tuple[str, int, int]:
    """``(pool name, num_slots, slot_bytes)`` from the stack file and ``--slot-bytes``."""
    from kvtiers.core.geometry import ChunkGeometry
    from kvtiers.service.pool import PAGE

    config = load_stack_config(config_path)
    primary = config.tiers[0]
    if not isinstance(primary, CPUTierConfig):
        raise ConfigError("kvtiers serve needs a cpu tier first: its capacity sizes the pool",
                          path="tiers[0]", source=config.source)
    try:
        check_service_tenants(config)
    except ConfigError as exc:
        raise _located(exc, config_path) from None
    if slot_bytes is None:
        if config.model is None:
            raise ConfigError("give --slot-bytes or a model: section (its chunk size sets "
                              "the pool's slot size)", path="model", source=config.source)
        slot_bytes = ChunkGeometry.from_config(config.model.to_offloading_config(0)).slot_bytes
    slot_bytes = -(-slot_bytes // PAGE) * PAGE
    num_slots = primary.capacity // slot_bytes
    if num_slots < 1:
        raise ConfigError(f"capacity {primary.capacity} holds no slot of {slot_bytes} bytes",
                          path="tiers[0].capacity", source=config.source)
    return primary.shared_memory_name or DEFAULT_POOL, num_slots, slot_bytes


def serve(config_path: str, *, socket_path: Path | None = None, slot_bytes: int | None = None,
          group: str | None = None, fresh: bool = False, shm_dir: Path = SHM_DIR,
          metrics_port: int | None = None, metrics_addr: str = "127.0.0.1") -> int:
    """Run the service until SIGTERM or SIGINT (then drain and return 0); with
    ``metrics_port``, export its metrics there (:mod:`kvtiers.service.metrics`)."""
    from kvtiers.service.pool import Layout, Pool
    from kvtiers.service.server import Service

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    name, num_slots, slot = pool_settings(config_path, slot_bytes)
    config = load_stack_config(config_path)
    token = admin_token(config, metrics_port)
    gid = grp.getgrnam(group).gr_gid if group is not None else None
    path = socket_path or default_socket()
    _socket_dir(path, gid)
    pool = Pool(shm_dir / name, Layout(num_slots, slot), group_access=gid is not None,
                fresh=fresh)
    if gid is not None:
        os.chown(pool.path, -1, gid)
    ledger = None
    try:
        book = None
        if config.retention is not None:
            from kvtiers.service.retention import service_book

            book = service_book(config, slot)
        service = Service(pool, path, group=gid, lower=config, tenants=config.tenants,
                          pool_tier=config.tiers[0].name, retention=book)
        service.retention_hints = config.retention is None or config.retention.hints
        exporter = None
        if metrics_port is not None:
            from kvtiers.service.metrics import start_exporter
            from kvtiers.service.retention import service_admin

            admin = None if token is None or book is None else service_admin(
                config, book, token, service.snapshot)
            exporter = start_exporter(service.snapshot, port=metrics_port, addr=metrics_addr,
                                      admin=admin)
        if book is not None and config.retention is not None and config.retention.ledger:
            from kvtiers.stack.ledger import LedgerWriter

            ledger = LedgerWriter(book, Path(config.retention.ledger),
                                  config.retention.ledger_interval_s)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: service.stop())
        # The line a supervisor (or a test) waits for: the socket accepts from here on.
        print(f"kvtiers serve: ready on {path} (adopted {service.adoption.total})",
              flush=True)
        service.serve()
        if exporter is not None:
            exporter.shutdown()
    finally:
        if ledger is not None:
            ledger.close()
        pool.close()
    return 0


def print_status(state: dict[str, Any], *, as_json: bool) -> None:
    """``kvtiers status``'s report: JSON, or a few readable lines."""
    if as_json:
        json.dump(state, sys.stdout, indent=2, sort_keys=True)
        print()
        return
    used, total = state["used_slots"], state["num_slots"]
    print(f"service on {state['socket']}, pool {state['pool']}: {used}/{total} slots of "
          f"{state['slot_bytes']} bytes used ({state['ready_slots']} ready, "
          f"{state['pinned_slots']} pinned)")
    counters = state.get("counters", {})
    print("re-adopted {}; freed at start: {} torn, {} corrupt, {} foreign".format(
        counters.get("adopted", 0), counters.get("adopt_torn", 0),
        counters.get("adopt_corrupt", 0), counters.get("adopt_foreign", 0)))
    for ns in state["namespaces"]:
        print(f"namespace {ns['name']}: {ns['chunks']} chunks, {ns['bytes']} bytes, "
              f"{ns['hits']} hits, {ns['adopted']} adopted")
    for engine in state["engines"]:
        print(f"engine pid {engine['pid']} ({engine['engine'] or 'no name'}): namespaces "
              f"{engine['namespaces']}, {engine['pins']} pins, {engine['hits']} hits of "
              f"{engine['lookups']} lookups, {engine['stored']} chunks stored")
    lowers = state.get("lower_tiers", [])
    if not lowers:
        print("lower tiers: none (the service runs the pool only)")
    for entry in lowers:
        print(f"namespace {entry['namespace']}: {entry['promotions']} promoted, "
              f"{entry['cascades']} cascaded, {entry['demotions']} demoted "
              f"({entry['promotion_failures']}, {entry['cascade_failures']} and "
              f"{entry['demotion_failures']} failed, {entry['demotions_dropped']} dropped)")
        for tier in entry["tiers"]:
            indexed = "indexed" if tier["indexed"] else "indexing"
            print(f"  lower tier {tier['name']}: {tier['chunks']} chunks ({indexed}), "
                  f"{tier['cascaded']} cascaded, {tier['promoted']} promoted, "
                  f"{tier['demoted']} demoted")
    for index, why in state.get("lower_tiers_refused", {}).items():
        print(f"namespace {index}: no lower tiers ({why})")
    for tenant in state.get("tenants", []):
        quota = tenant["quota_bytes"]
        print(f"tenant {tenant['name']}: {tenant['chunks']} chunks, {tenant['bytes']} bytes "
              f"in the pool (quota {'none' if quota is None else quota}, protected "
              f"{tenant['protected_bytes']})")
        for tier, held in tenant.get("lower_bytes", {}).items():
            quota = tenant["lower_quota_bytes"].get(tier)
            print(f"  tier {tier}: {held} bytes (quota {'none' if quota is None else quota})")
    retention = state.get("retention")
    if retention is not None:
        print("retention: {} hints ({} ignored), {} pins ({} refused, {} overridden), {} "
              "chunks evicted at their expiry".format(
                  retention.get("retention_hints", 0),
                  retention.get("retention_hints_ignored", 0),
                  retention.get("retention_pins", 0),
                  retention.get("retention_pins_refused", 0),
                  retention.get("retention_pins_overridden", 0),
                  state.get("counters", {}).get("retention_expired_evictions", 0)))
        for pins in retention["pins"]:
            whose = "the pool" if pins["tenant"] is None else f"tenant {pins['tenant']}"
            print(f"  {whose}: {pins['pinned_bytes']} bytes pinned (cap "
                  f"{pins['max_pinned_bytes']})")
