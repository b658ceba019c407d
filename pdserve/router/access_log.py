"""The router's HTTP access log: aiohttp's, except that probes and scrapes are logged at DEBUG.

A load balancer or `pdserve serve` polls GET /health every second or so and Prometheus scrapes
GET /metrics: at INFO those lines would bury the requests worth reading. Every other request is
logged exactly as aiohttp's default access logger does (logger "aiohttp.access", level INFO).
Pass the class to `web.run_app(access_log_class=...)` (router/cli.py).
"""

from __future__ import annotations

import logging

from aiohttp.web import BaseRequest, StreamResponse
from aiohttp.web_log import AccessLogger

QUIET_PATHS = frozenset({"/health", "/metrics", "/planner"})  # polled by machines (pdserve serve polls /planner): logged at DEBUG


class RouterAccessLogger(AccessLogger):
    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        if request.path not in QUIET_PATHS:
            super().log(request, response, time)
        elif self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug('%s "%s %s" %d %.3fs', request.remote, request.method, request.path_qs,
                              response.status, time)
