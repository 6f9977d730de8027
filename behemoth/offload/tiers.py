"""The storage tiers, where they live now (parallel/zero/tiers.py: one tier module for ZeRO-3 and offload)."""

from behemoth.parallel.zero.tiers import OLDER_SPELLINGS, TIER_NAMES, DeviceTier, FileTier, HostTier, Tier, make_tier, tier_name

__all__ = ["OLDER_SPELLINGS", "TIER_NAMES", "DeviceTier", "FileTier", "HostTier", "Tier", "make_tier", "tier_name"]
