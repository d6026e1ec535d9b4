"""Prometheus view of the control plane's counters (ServerStats), collected on scrape so the
server's hot path only bumps plain integers. NACK error details are exported as the
`detail` label of `meshd_xds_last_nack_info` (one series per type URL)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from xds.eds import EdsView
from xds.eds_shards import ShardedEds
from xds.server import ServerStats

__all__ = ["ServerStatsCollector"]

# Long error details are cut so one bad publisher cannot bloat every scrape.
MAX_DETAIL_CHARS = 200


class ServerStatsCollector(Collector):
    def __init__(
        self, stats: ServerStats, eds: EdsView | None = None, shards: ShardedEds | None = None
    ) -> None:
        self.stats = stats
        self.eds = eds
        self.shards = shards

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | InfoMetricFamily]:
        s = self.stats
        yield GaugeMetricFamily("meshd_xds_streams_open", "ADS streams open", value=s.streams_open)
        for name, doc, counts in (
            ("meshd_xds_responses", "Discovery responses sent, by type", s.responses),
            ("meshd_xds_acks", "Responses ACKed, by type", s.acks),
            ("meshd_xds_nacks", "Responses NACKed, by type", s.nacks),
            ("meshd_xds_coalesced", "Updates merged into a pending one, by type", s.coalesced),
        ):
            family = CounterMetricFamily(name, doc, labels=["type_url"])
            for type_url, n in sorted(counts.items()):
                family.add_metric([type_url], n)
            yield family
        yield CounterMetricFamily(
            "meshd_xds_stale_nonces", "Requests with a superseded nonce", value=s.stale_nonces
        )
        yield CounterMetricFamily("meshd_xds_publishes", "Publishes accepted", value=s.publishes)
        yield CounterMetricFamily(
            "meshd_xds_publishes_rejected", "Publishes refused", value=s.publishes_rejected
        )
        yield CounterMetricFamily(
            "meshd_xds_expired_resources",
            "Engines' resources removed for want of publishes (resource TTL)",
            value=s.expired,
        )
        info = InfoMetricFamily(
            "meshd_xds_last_nack", "The last NACK's error detail", labels=["type_url"]
        )
        for type_url, detail in sorted(s.last_nack.items()):
            info.add_metric([type_url], {"detail": detail[:MAX_DETAIL_CHARS]})
        yield info
        if self.eds is not None:
            yield GaugeMetricFamily(
                "meshd_xds_eds_pools",
                "Pools served as ClusterLoadAssignment",
                len(self.eds.pools()),
            )
            yield GaugeMetricFamily(
                "meshd_xds_eds_skipped_engines",
                "Engines left out of EDS (address not IP:port)",
                len(self.eds.skipped),
            )
        if self.shards is not None:
            connected = GaugeMetricFamily(
                "meshd_xds_eds_shard_connected",
                "Another control-plane shard followed for EDS: 1 while connected",
                labels=["shard"],
            )
            in_view = GaugeMetricFamily(
                "meshd_xds_eds_shard_in_view",
                "Another shard's engines in the EDS view: 0 once it was unreachable for "
                "--shard-stale-s",
                labels=["shard"],
            )
            for h in self.shards.health():
                connected.add_metric([str(h["target"])], float(bool(h["connected"])))
                in_view.add_metric([str(h["target"])], float(bool(h["in_view"])))
            yield connected
            yield in_view
