"""gRPC shells around the exchange protocol: the servicer, channels, stream driver, rate limit."""
