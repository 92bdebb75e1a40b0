"""Sharded (FSDP2) training: where the shards of each parameter live, as the mechanism sees them."""
