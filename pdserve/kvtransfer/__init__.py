"""pdserve.kvtransfer: the wire between router, prefill and decode nodes (messages, sockets, KV hand-off)."""
