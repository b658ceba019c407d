"""What every serving node runs, whatever its role (prefill/ and decode/ keep only what differs):

    runtime.py        run_node: start-up wiring, serve_node (loop, drain), stop handlers
    router_link.py    RouterLink: one router: register, heartbeats, Reregister, connection loss;
                      the addresses a node advertises
    router_links.py   RouterLinks: every router; each request's origin, per-router tokens and
                      heartbeat lists, the requests of a router that died aborted
    router_discovery.py  --router values and DNS names → router addresses, re-resolved
    status_server.py  StatusServer: GET /status, /metrics, /health
    metrics.py        NodeSnapshot and the Prometheus metrics read from it
    stats.py          the periodic stats line
    engine_wire.py    wire messages built from engine state (Register, KVLayout, Token), the KV shards
    local_requests.py LocalRequests: requests a node prefills and decodes itself (colocated, a
                      decode node's local prefill): admission, first tokens, decoding there
    step_samples.py   StepSamples: per engine step [prefill tokens, decode seqs, context, seconds]
                      for every router's heartbeats
    role_switch.py    RoleSwitcher: a node process changing role on SetRole; SenderSlot
    args.py           the node flags; the CURVE keys they name
    faults.py         FaultInjection: the test and chaos hook (slow steps, slow pulls, spoiled KV)
"""
