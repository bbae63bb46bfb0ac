"""ferry: LLM serving as NATS microservices."""

__version__ = "0.1.0"
