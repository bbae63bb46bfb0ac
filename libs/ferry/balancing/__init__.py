"""What the prefill- and decode-balancer share; each balancer (ferry_services.prefill_balancer,
.decode_balancer) keeps only its own policy and endpoint. See docs/internals.md ("Balancers").

- `view`: the live worker view and load tracking (`WorkerView`, `WorkerState`). Pure: no NATS, no
  clock; the balancers' pure policies import it.
- `runtime`: `BalancerRuntime`, the I/O around the view: load reports in (a counted subscription),
  work out to JetStream, silent workers' queues moved to live workers.
- `balancer`: `Balancer`, the shape of a balancer service, and `serve_balancer`, its entry point.
- `settings`: `BalancerSettings`, what every balancer is configured with.

Nothing is re-exported here, so that importing the pure view never loads NATS.
"""
