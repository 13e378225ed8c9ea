"""The pure GASLoC algorithm core: functions and small state objects over flat tensors.

Imports only torch and the standard library; nothing here knows about asyncio, gRPC, hivemind or
Prometheus. The simulator and the node daemon are two drivers of this core.
"""
