"""All-reduce for the DiLoCo modes: the :class:`~.base.Averager` seam and its hivemind implementation."""
