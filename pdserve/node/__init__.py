"""What every serving node runs, whatever its role: the link to the router, the status and metrics server, the serve loop."""
