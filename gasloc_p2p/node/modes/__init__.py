"""Outer algorithms as node modes: GASLoC gossip and the DiLoCo all-reduce."""
