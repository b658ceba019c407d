"""pdserve.decode_node: the decode node (take announced KV, pull it, continuous decode) and its process."""
