"""Simulation without payload: trace replay through the store's BlockIndex, and a
cluster of such caches behind a router."""
from __future__ import annotations

from kvtier.sim.replay import ReplayResult, build_policy, capacity_for, replay

__all__ = ["ReplayResult", "build_policy", "capacity_for", "replay"]
