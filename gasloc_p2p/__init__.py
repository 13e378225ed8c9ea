"""gasloc_p2p: peer-to-peer volunteer training with GASLoC (gossip + DiLoCo-style local steps).

Layers (enforced by tests/test_layers.py):
- ``gasloc_p2p.core``: the pure algorithm (torch + standard library only).
- ``gasloc_p2p.model`` / ``gasloc_p2p.data``: the tiny GPT and the text data.
- ``gasloc_p2p.sim``: the in-process swarm simulator (a driver of the core).
- ``gasloc_p2p.node``: the daemon (asyncio, gRPC, hivemind DHT, Prometheus).
"""

__version__ = "0.1.0"
