"""pdserve.decode: the decode node (take announced KV, pull it, continuous decode) and its process."""
