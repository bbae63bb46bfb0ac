"""OpenAI-compatible HTTP gateway: validates, tokenizes, submits to the bus, streams tokens back.

Reads `ferry.out.<gateway_id>` (token events) and `ferry.load.>` (worker liveness for /ready);
writes `ferry.submit` (request/reply to the prefill-balancer) and `ferry.cancel`.
"""
