"""What `cdc check` says about the sentinels of a ``redis+sentinel://`` URL.

Each sentinel is asked, with the sentinels' own login, for the master of the
service (``SENTINEL get-master-addr-by-name``) and one of them for its replicas
(``SENTINEL replicas``): how many answer, whether they agree on the master, and
each replica's link. A failover needs a majority of the sentinels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from ..config import RedisSettings
from ..errors import CdcError, PublishError, TransientError
from ..sink.redisconn import connect_sentinels, parse_sentinel_url

__all__ = ["SentinelReport", "check_sentinels"]


@dataclass
class SentinelReport:
    ok: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    problems: list[CdcError] = field(default_factory=list)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def check_sentinels(settings: RedisSettings) -> SentinelReport:
    report = SentinelReport()
    target = parse_sentinel_url(settings.url)
    sentinels = connect_sentinels(settings, target, socket_timeout=5)
    named: dict[str, list[str]] = {}
    reachable: list[redis.Redis] = []
    try:
        for (host, port), client in zip(target.sentinels, sentinels.sentinels):
            at = f"sentinel {host}:{port}"
            try:
                reply = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", target.service)
            except redis.AuthenticationError as exc:
                report.problems.append(PublishError(
                    f"{at} refused the login: {exc}",
                    hint="check redis.sentinel_username and redis.sentinel_password (the sentinels' own login)"))
                continue
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                report.warnings.append(f"{at} is unreachable: {exc}")
                continue
            except redis.ResponseError as exc:
                report.problems.append(PublishError(
                    f"{at} refused SENTINEL get-master-addr-by-name: {exc}",
                    hint="grant the sentinel user +sentinel|get-master-addr-by-name +sentinel|replicas"))
                continue
            reachable.append(client)
            if not reply:
                report.problems.append(PublishError(
                    f"{at} monitors no master named {target.service!r}",
                    hint="use the name of its 'sentinel monitor' line as the service in redis.url"))
                continue
            named.setdefault(f"{_text(reply[0])}:{_text(reply[1])}", []).append(f"{host}:{port}")
        total = len(target.sentinels)
        if not reachable:
            report.problems.append(TransientError(
                f"none of the {total} sentinels of {target.service!r} answered",
                hint="check the sentinel addresses in redis.url and that the sentinels are running"))
            return report
        report.ok.append(f"{len(reachable)} of {total} sentinels answer for {target.service!r}")
        if len(reachable) * 2 <= total:
            report.warnings.append(
                f"only {len(reachable)} of {total} sentinels answer: a failover needs a majority of them")
        if len(named) > 1:
            report.warnings.append(
                "the sentinels disagree on the master of {!r}: {} (a failover in progress?)".format(
                    target.service, "; ".join(f"{m} by {', '.join(by)}" for m, by in named.items())))
        elif named:
            report.ok.append(f"the sentinels name {next(iter(named))} as the master of {target.service!r}")
        _replicas(reachable[0], target.service, settings.wait_replicas, report)
    finally:
        sentinels.close()
    return report


def _replicas(client: redis.Redis, service: str, wait_replicas: int, report: SentinelReport) -> None:
    try:
        replicas = client.execute_command("SENTINEL", "REPLICAS", service)
    except redis.RedisError as exc:
        report.warnings.append(f"cannot list the replicas of {service!r}: {exc}")
        return
    if not replicas:
        report.warnings.append(f"the sentinels know no replica of {service!r}: a failover has nothing to promote")
    elif wait_replicas and len(replicas) <= wait_replicas:
        report.warnings.append(
            f"{service!r} has {len(replicas)} replica(s) and redis.wait_replicas is {wait_replicas}: after a failover "
            f"the promoted master has {len(replicas) - 1}, and cdc run retries every batch until the old master "
            f"rejoins as a replica; run {wait_replicas + 1} replicas")
    for raw in replicas:
        info = raw if isinstance(raw, dict) else dict(zip(raw[::2], raw[1::2]))
        info = {_text(k): _text(v) for k, v in info.items()}
        where = f"replica {info.get('ip')}:{info.get('port')}"
        flags, link = info.get("flags", ""), info.get("master-link-status", "?")
        if "s_down" in flags or "disconnected" in flags or link != "ok":
            report.warnings.append(f"{where}: link {link}, flags {flags}: it cannot take over cleanly")
        else:
            report.ok.append(f"{where}: link {link}")
