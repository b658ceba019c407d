"""What every serving node runs, whatever its role (prefill/ and decode/ keep only what differs):

    runtime.py        run_node: start-up wiring, serve_node (loop, drain), stop handlers
    router_link.py    RouterLink: register, heartbeats, Reregister; the addresses a node advertises
    status_server.py  StatusServer: GET /status, /metrics, /health
    metrics.py        NodeSnapshot and the Prometheus metrics read from it
    stats.py          the periodic stats line
    messages.py       wire messages built from engine state (Register, KVLayout, Token)
    args.py           the node flags; the CURVE keys they name
    faults.py         FaultInjection: the test and chaos hook (slow steps, slow pulls, spoiled KV)
"""
