"""Each registered client's device, network and time zone, drawn once from the seed.

Drawn for every client at once as arrays (a million registered clients cost a few arrays of a
million numbers), in a fixed order from one stream, so the same scenario and seed give every
client the same profile on any machine. A client's speed and bandwidths are its class's medians
times exp(spread · N(0, 1)); attackers with `attackers.device: fastest` get the fastest classes'
medians instead (no spread).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedsim.seeding import CLOCK, numpy_rng

PROFILES = 0  # sub-stream of CLOCK for the profiles (rounds use 1 + round)


@dataclass(frozen=True)
class ClientProfiles:
    gflops: np.ndarray  # [n] effective training throughput, GFLOP/s
    down_bps: np.ndarray  # [n] downlink, bit/s
    up_bps: np.ndarray  # [n] uplink, bit/s
    latency_s: np.ndarray  # [n] one-way latency per transfer, s
    timezone: np.ndarray  # [n] hours added to time zone 0's clock
    device_class: np.ndarray  # [n] index into systems.devices
    network_class: np.ndarray  # [n] index into systems.networks

    def describe(self, pid: int, systems) -> dict:
        """One client's profile in words and numbers (for logs and docs)."""
        return {"device": systems.devices[self.device_class[pid]].name, "gflops": float(self.gflops[pid]),
                "network": systems.networks[self.network_class[pid]].name, "down_mbps": float(self.down_bps[pid]) / 1e6,
                "up_mbps": float(self.up_bps[pid]) / 1e6, "latency_ms": float(self.latency_s[pid]) * 1e3,
                "timezone": float(self.timezone[pid])}


def _classes(rng: np.random.Generator, shares: list[float], n: int) -> np.ndarray:
    p = np.asarray(shares, dtype=np.float64)
    return rng.choice(len(p), size=n, p=p / p.sum())


def draw_profiles(systems, num_clients: int, attackers: list[int], seed: int) -> ClientProfiles:
    rng = numpy_rng(seed, CLOCK, PROFILES)
    n = num_clients
    dev = _classes(rng, [d.share for d in systems.devices], n)
    net = _classes(rng, [c.share for c in systems.networks], n)
    z_dev, z_down, z_up = rng.standard_normal(n), rng.standard_normal(n), rng.standard_normal(n)
    zones = systems.availability.diurnal.timezones if systems.availability.diurnal is not None else 24
    timezone = rng.integers(0, zones, size=n) * (24.0 / zones)

    def attr(classes, values, spread, z):
        return np.asarray(values)[classes] * np.exp(np.asarray(spread)[classes] * z)

    gflops = attr(dev, [d.gflops for d in systems.devices], [d.spread for d in systems.devices], z_dev)
    nets = systems.networks
    down = attr(net, [c.down_mbps * 1e6 for c in nets], [c.spread for c in nets], z_down)
    up = attr(net, [c.up_mbps * 1e6 for c in nets], [c.spread for c in nets], z_up)
    latency = np.asarray([c.latency_ms / 1e3 for c in nets])[net]
    if attackers and systems.attackers.device == "fastest":
        a = np.asarray(sorted(attackers))
        fast_dev = max(range(len(systems.devices)), key=lambda i: systems.devices[i].gflops)
        fast_net = max(range(len(nets)), key=lambda i: (nets[i].up_mbps, nets[i].down_mbps))
        dev[a], net[a] = fast_dev, fast_net
        gflops[a] = systems.devices[fast_dev].gflops
        down[a], up[a], latency[a] = nets[fast_net].down_mbps * 1e6, nets[fast_net].up_mbps * 1e6, nets[fast_net].latency_ms / 1e3
    return ClientProfiles(gflops, down, up, latency, timezone, dev, net)
