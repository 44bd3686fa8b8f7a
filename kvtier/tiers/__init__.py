"""Tiers: fixed-size slot pools holding whole blocks, from fastest to largest."""
from kvtier.tiers.base import Tier
from kvtier.tiers.device import DeviceTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier

__all__ = ["Tier", "DeviceTier", "HostTier", "DiskTier"]
